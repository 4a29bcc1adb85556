"""Where a sample of a job's items sits: one place per equal stretch, the same on every run, and not
fooled by a job that repeats itself at the stretch's period."""

from __future__ import annotations

import pytest

from layerbus.planner.sample_places import sample_places


@pytest.mark.parametrize("count, total", [(1, 1), (1, 7), (3, 10), (10, 100), (4096, 1_000_000), (4096, 4097)])
def test_one_place_in_each_stretch(count: int, total: int) -> None:
    places = sample_places(count, total)
    assert len(places) == count and places == sorted(set(places)) and sample_places(count, total) == places
    assert all(i * total // count <= p < (i + 1) * total // count for i, p in enumerate(places))  # p in stretch i


def test_a_small_job_is_taken_whole_and_a_sample_has_an_item() -> None:
    assert sample_places(50, 20) == list(range(20)) and sample_places(5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="count=0"):
        sample_places(0, 10)


def test_a_job_repeating_itself_at_the_stretch_period_is_sampled_in_proportion() -> None:
    # every tenth item is special; a sample of one item in ten at a fixed place in each stretch sees all or none
    places = sample_places(1000, 10_000)
    assert sum(1 for p in places if p % 10 == 9) == pytest.approx(100, abs=10)
