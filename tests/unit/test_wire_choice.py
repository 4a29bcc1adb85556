"""Which codec each link gets (planner/wire_choice.py): fixed settings, and auto mode's pure choice."""

from __future__ import annotations

import json

import pytest

from layerbus.planner.wire_choice import (
    QualityBudget,
    WireConfigError,
    choose_codec,
    link_codecs,
    load_quality_table,
    plan_link_codecs,
    AutoWireInputs,
)

# Measured-like quality (SmolLM2 shapes): int4 outside the default budget, int8 inside.
TABLE = {
    "float16": {"mean_kl": 2e-7, "same_top": 1.0, "bytes_ratio": 0.5},
    "bfloat16": {"mean_kl": 1e-5, "same_top": 0.999, "bytes_ratio": 0.5},
    "int8": {"mean_kl": 6e-5, "same_top": 0.998, "bytes_ratio": 0.268},
    "int4": {"mean_kl": 0.017, "same_top": 0.945, "bytes_ratio": 0.149},
}
STEP_BYTES = 32 * 576 * 4  # a decode step of 32 rows of SmolLM2 hidden states, float32
MBIT = 1e6 / 8


@pytest.mark.parametrize("bandwidth, compute_s, table, budget, expected", [
    # Unmeasured link or compute: the cheapest codec within budget.
    (None, 0.05, TABLE, QualityBudget(), "int8"),
    (100 * MBIT, None, TABLE, QualityBudget(), "int8"),
    # A loose budget admits int4.
    (None, None, TABLE, QualityBudget(max_mean_kl=0.02, min_same_top=0.94), "int4"),
    # A budget nothing meets but float32, the reference.
    (None, None, TABLE, QualityBudget(max_mean_kl=0.0, min_same_top=1.0), "float32"),
    # Fast link: float32's 74 KB per step take 0.6 ms at 1 Gbit/s, far under half a 50 ms step.
    (1000 * MBIT, 0.05, TABLE, QualityBudget(), "float32"),
    # 20 Mbit/s: float32 needs 29 ms > 25 ms, float16 15 ms fits: the most faithful that hides.
    (20 * MBIT, 0.05, TABLE, QualityBudget(), "float16"),
    # 8 Mbit/s: float16 37 ms does not fit, int8 20 ms does.
    (8 * MBIT, 0.05, TABLE, QualityBudget(), "int8"),
    # 2 Mbit/s: nothing hides behind compute: the cheapest within budget.
    (2 * MBIT, 0.05, TABLE, QualityBudget(), "int8"),
    # Empty table: only float32 is known to be within budget.
    (2 * MBIT, 0.05, {}, QualityBudget(), "float32"),
])
def test_choose_codec(bandwidth, compute_s, table, budget, expected):
    assert choose_codec(bandwidth, compute_s, STEP_BYTES, table, budget) == expected


def test_link_codecs_fixed_settings():
    assert link_codecs("int8", 2) == ["int8", "int8"]
    assert link_codecs(("float16", "int4"), 2) == ["float16", "int4"]
    assert link_codecs("float32", 0) == []
    assert link_codecs(("auto", "int8"), 2) is None
    with pytest.raises(WireConfigError, match=r"lists 1 codec\(s\) \['int8'\] for 2 link\(s\) between 3 stages"):
        link_codecs(("int8",), 2)
    with pytest.raises(WireConfigError, match=r"'int3' is not one of"):
        link_codecs("int3", 1)


def test_auto_reads_the_saved_table_and_mixes_with_fixed_links(tmp_path):
    table = tmp_path / "q.json"
    table.write_text(json.dumps({"codecs": TABLE}))
    auto = AutoWireInputs(quality_table=str(table), link_bandwidth=(None, 1000 * MBIT), compute_s_per_step=0.05)
    assert plan_link_codecs(("auto", "auto", "int4"), 3, STEP_BYTES, "unused", auto) == ["int8", "float32", "int4"]


def test_auto_without_a_table_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERBUS_HOME", str(tmp_path))
    with pytest.raises(WireConfigError, match=r"run `layerbus wire-quality --model /models/x --save` first"):
        plan_link_codecs("auto", 1, STEP_BYTES, "/models/x")
    broken = tmp_path / "broken.json"
    broken.write_text('{"codecs": {"int8": {"mean_kl": 1}}}')
    with pytest.raises(WireConfigError, match=r"is not a wire-quality table \(KeyError"):
        load_quality_table("/models/x", str(broken))
