"""Telling a slowed stage from a change in the work (planner.drift), by table."""

from __future__ import annotations

import pytest

from layerbus.planner.drift import DriftConfig, DriftWatch, Work, relative_slowdowns

CASES = {
    "nobody changed": ({"a": 0.1, "b": 0.2}, {"a": 0.1, "b": 0.2}, {"a": 1.0, "b": 1.0}),
    "one stage 3x slower": ({"a": 0.1, "b": 0.2}, {"a": 0.1, "b": 0.6}, {"a": 1.0, "b": 3.0}),
    "the work doubled for all: nobody slowed": ({"a": 0.1, "b": 0.2}, {"a": 0.2, "b": 0.4}, {"a": 1.0, "b": 1.0}),
    "the work doubled and one slowed 3x more": ({"a": 0.1, "b": 0.2, "c": 0.1}, {"a": 0.2, "b": 1.2, "c": 0.2},
                                                {"a": 1.0, "b": 3.0, "c": 1.0}),
    "a stage without a baseline is left out": ({"a": 0.1}, {"a": 0.1, "new": 0.5}, {"a": 1.0}),
    "no data": ({}, {}, {}),
}


@pytest.mark.parametrize("baseline, current, expected", CASES.values(), ids=CASES.keys())
def test_relative_slowdowns(baseline, current, expected):
    assert relative_slowdowns(baseline, current) == pytest.approx(expected)


def stats(busy: dict[str, float], steps: int) -> dict[str, dict]:
    return {name: {"busy_s": value, "steps": steps} for name, value in busy.items()}


def test_a_stage_is_slowed_after_enough_windows_in_a_row():
    watch = DriftWatch(DriftConfig(window_s=5, threshold=2.0, windows=2, min_steps=4))
    watch.restart(0.0, stats({"a": 0.0, "b": 0.0}, 0), Work())
    assert watch.observe(4.9, stats({"a": 1.0, "b": 1.0}, 10)) is None  # the window is not over
    assert watch.observe(5.0, stats({"a": 1.0, "b": 1.0}, 10)) is None  # the baseline: 0.1 s per step each
    assert watch.observe(10.0, stats({"a": 2.0, "b": 4.0}, 20)) is None  # b 3x slower: one strike
    assert watch.observe(15.0, stats({"a": 3.0, "b": 5.1}, 30)) is None  # b back to normal: strikes reset
    assert watch.observe(20.0, stats({"a": 4.0, "b": 8.1}, 40)) is None  # b slow again: one strike
    assert watch.observe(25.0, stats({"a": 5.0, "b": 11.1}, 50)) == pytest.approx({"b": 3.0})


def test_a_window_with_too_few_steps_judges_nobody():
    watch = DriftWatch(DriftConfig(window_s=1, threshold=2.0, windows=1, min_steps=4))
    watch.restart(0.0, stats({"a": 0.0, "b": 0.0}, 0), Work())
    assert watch.observe(1.0, stats({"a": 1.0, "b": 1.0}, 10)) is None  # baseline
    assert watch.observe(2.0, {"a": {"busy_s": 1.1, "steps": 11}, "b": {"busy_s": 5.0, "steps": 12}}) is None
    assert watch.observe(3.0, {"a": {"busy_s": 2.1, "steps": 21}, "b": {"busy_s": 9.0, "steps": 22}}) == \
        pytest.approx({"b": 4.0})


def test_a_restart_takes_a_new_baseline():
    watch = DriftWatch(DriftConfig(window_s=1, threshold=2.0, windows=1))
    watch.restart(0.0, stats({"a": 0.0, "b": 0.0}, 0), Work())
    watch.observe(1.0, stats({"a": 1.0, "b": 1.0}, 10))
    watch.restart(1.0, stats({"a": 1.0, "b": 1.0}, 10), Work())  # layers moved: b's normal is now different
    assert watch.observe(2.0, stats({"a": 2.0, "b": 4.0}, 20)) is None  # the new baseline
    assert watch.observe(3.0, stats({"a": 3.0, "b": 7.0}, 30)) is None


def test_disabled_never_reports():
    watch = DriftWatch(DriftConfig(enabled=False, window_s=1, windows=1))
    watch.restart(0.0, stats({"a": 0.0, "b": 0.0}, 0), Work())
    for t in range(1, 5):
        assert watch.observe(float(t), stats({"a": t * 1.0, "b": t * t * 10.0}, 10 * t)) is None


@pytest.mark.parametrize("fields", [{"threshold": 1.0}, {"window_s": 0}, {"windows": 0}, {"min_gain": 1.0}])
def test_bad_config_is_refused(fields):
    with pytest.raises(ValueError):
        DriftConfig(**fields)


def test_work_priced_by_profile_tells_a_phase_change_from_a_slowdown():
    """Prefill costs stage a 4x what it costs stage b per token, decode the reverse: moving from a
    prefill phase to a decode phase shifts busy time between them, which is no slowdown."""
    prices = {"a": (4.0, 1.0), "b": (1.0, 4.0)}  # seconds per prefill token, per decode row

    def expected(name: str, work: Work) -> float:
        prefill, decode = prices[name]
        return prefill * work.prefill_tokens + decode * work.decode_rows

    def busy(slow_b: float, work: Work) -> dict[str, float]:
        return {"a": expected("a", work), "b": expected("b", work) * slow_b}

    watch = DriftWatch(DriftConfig(window_s=1, threshold=2.0, windows=1, min_steps=1), expected)
    watch.restart(0.0, stats({"a": 0.0, "b": 0.0}, 0), Work())
    prefill_phase = Work(steps=10, prefill_tokens=100)
    totals = busy(1.0, prefill_phase)
    assert watch.observe(1.0, stats(totals, 10), prefill_phase) is None  # baseline, in the prefill phase
    decode_phase = Work(steps=20, prefill_tokens=100, decode_rows=100)
    step = busy(1.0, decode_phase - prefill_phase)
    totals = {name: totals[name] + step[name] for name in totals}
    assert watch.observe(2.0, stats(totals, 20), decode_phase) is None  # the phase changed, nobody slowed
    slowed_phase = Work(steps=30, prefill_tokens=100, decode_rows=200)
    step = busy(3.0, slowed_phase - decode_phase)
    totals = {name: totals[name] + step[name] for name in totals}
    assert watch.observe(3.0, stats(totals, 30), slowed_phase) == pytest.approx({"b": 3.0})

    counting_steps = DriftWatch(DriftConfig(window_s=1, threshold=2.0, windows=1, min_steps=1))
    counting_steps.restart(0.0, stats({"a": 0.0, "b": 0.0}, 0), Work())
    totals = busy(1.0, prefill_phase)
    counting_steps.observe(1.0, stats(totals, 10), prefill_phase)
    step = busy(1.0, decode_phase - prefill_phase)
    totals = {name: totals[name] + step[name] for name in totals}
    assert counting_steps.observe(2.0, stats(totals, 20), decode_phase) == pytest.approx({"b": 16.0}), \
        "counting steps alone would take the phase change for a slowdown"
