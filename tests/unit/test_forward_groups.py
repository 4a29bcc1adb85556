"""How a step's rows are grouped for the forward pass: decode rows together, prefill chunks padded
together while padding stays small, and never past the cache's context."""

from __future__ import annotations

import pytest

from layerbus.stages.forward import plan_groups
from layerbus.wire.protocol import StepRow


def rows_of(spec: list[tuple[int, int, int]]) -> list[StepRow]:
    return [StepRow(slot, start, length) for slot, start, length in spec]


@pytest.mark.parametrize("spec, max_context, expected", [
    pytest.param([(0, 5, 1), (1, 9, 1)], None, [([0, 1], 1, None)], id="decode rows: one group"),
    pytest.param([(0, 0, 40), (1, 0, 38), (2, 0, 36)], None, [([0, 1, 2], 40, [40, 38, 36])],
                 id="similar chunks: padded to the longest"),
    pytest.param([(0, 0, 40), (1, 0, 8)], None, [([0], 40, None), ([1], 8, None)],
                 id="padding 8 to 40 would add more than a quarter: apart"),
    pytest.param([(3, 0, 10), (4, 12, 10), (5, 0, 9)], None, [([3, 4, 5], 10, [10, 10, 9])],
                 id="longest first, then by position in the step"),
    pytest.param([(0, 0, 10), (1, 60, 9)], 64, [([0], 10, None), ([1], 9, None)],
                 id="a padded row must end within the context"),
    pytest.param([(0, 7, 1), (1, 0, 6), (2, 3, 6)], None, [([0], 1, None), ([1, 2], 6, None)],
                 id="decode group first, then the prefill group"),
])
def test_plan_groups(spec, max_context, expected) -> None:
    groups = plan_groups(rows_of(spec), max_context)
    assert [(g.group.slots, g.group.length, g.group.real_lengths) for g in groups] == expected
    covered = sorted(i for g in groups for i in g.row_indices)
    assert covered == list(range(len(spec))), "every row in exactly one group"


def test_groups_stay_under_the_position_cap() -> None:
    rows = rows_of([(slot, 0, 200) for slot in range(8)])
    groups = plan_groups(rows)
    assert all(len(g.row_indices) * g.group.length <= 1024 for g in groups)
    assert sum(len(g.row_indices) for g in groups) == 8
