"""The placement value, the chain's one text form, and when a stage counts as lost: literal tables."""

from __future__ import annotations

import pytest

from layerbus.planner.chain import Placement
from layerbus.broker.control import StageInfo, StageState, lost_reason
from layerbus.wire.spans import LayerRange, format_chain


def spans(*bounds: int) -> tuple[LayerRange, ...]:
    return tuple(LayerRange(a, b) for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("names, layers, codecs, want", [
    (["stage-1", "stage-0"], spans(0, 24, 30), ["int8"], "stage-1 [0, 24) -int8-> stage-0 [24, 30)"),
    (["a", "b", "c"], spans(0, 1, 2, 3), ["float16", "int4"], "a [0, 1) -float16-> b [1, 2) -int4-> c [2, 3)"),
    (["a", "b"], spans(0, 1, 2), [], "a [0, 1) -> b [1, 2)"),  # no codecs known: plain links
    (["a", "b"], ["[0, 1)", "[1, 2)"], ["int8"], "a [0, 1) -int8-> b [1, 2)"),  # spans as text (run-info JSON)
    (["a", "b"], None, ["int8"], "a -int8-> b"),  # names alone
    (["solo"], spans(0, 4), [], "solo [0, 4)"),
])
def test_format_chain(names, layers, codecs, want):
    assert format_chain(names, layers, codecs) == want


def test_format_chain_refuses_mismatched_spans():
    with pytest.raises(ValueError, match=r"len\(names\)=2 stage names but len\(spans\)=1 spans"):
        format_chain(["a", "b"], spans(0, 1))


def test_placement_text_summary_and_run_info():
    placement = Placement(("stage-1", "stage-0"), spans(0, 24, 30), ("int8",), partition="balanced")
    assert placement.text() == "stage-1 [0, 24) -int8-> stage-0 [24, 30)"
    assert placement.summary() == "stage-1 [0, 24) -int8-> stage-0 [24, 30) (balanced)"
    assert placement.run_info() == {
        "stages": [{"name": "stage-1", "layers": "[0, 24)"}, {"name": "stage-0", "layers": "[24, 30)"}],
        "wire": [{"from": "stage-1", "to": "stage-0", "codec": "int8"}]}
    assert placement.span_of("stage-0") == LayerRange(24, 30) and placement.span_of("spare") is None
    assert placement.with_codecs(["float16"]).codecs == ("float16",) and placement.codecs == ("int8",)


@pytest.mark.parametrize("stages, layers, codecs, message", [
    ((), (), (), "at least one stage"),
    (("a", "b"), spans(0, 2), (), r"len\(self.stages\)=2 stages but len\(self.spans\)=1 spans"),
    (("a", "a"), spans(0, 1, 2), (), "unique"),
    (("a", "b"), (LayerRange(0, 1), LayerRange(2, 3)), (), r"contiguous, got \[0, 1\) then \[2, 3\)"),
    (("a", "b"), spans(0, 1, 2), ("int8", "int4"), r"2 stages have 1 links, got len\(self.codecs\)=2"),
])
def test_placement_refuses_inconsistent_values(stages, layers, codecs, message):
    with pytest.raises(ValueError, match=message):
        Placement(stages, layers, codecs)


def stage(state: StageState = StageState.READY, last_seen: float = 10.0, busy_s: float = 0.0,
          error: str | None = None) -> StageInfo:
    return StageInfo(b"s", "s", "cpu", "float32", 1, None, "tcp://x", "host", 7, last_seen=last_seen,
                     state=state, busy_s=busy_s, error=error)


@pytest.mark.parametrize("info, now, want", [
    (stage(), 12.0, None),
    (stage(StageState.LOADING), 12.0, None),
    (stage(state=StageState.GONE), 10.0, "it left (stopped or shut down)"),
    (stage(StageState.FAILED, error="RuntimeError: boom"), 10.0, "it reported: RuntimeError: boom"),
    (stage(), 15.5, "silent for 5.5 s (liveness window 5 s)"),
    (stage(busy_s=301.0), 10.0, "stuck in one step or load for 301 s (limit 300 s)"),
    (stage(StageState.GONE, last_seen=0.0), 15.5, "it left (stopped or shut down)"),  # leaving comes first
    (stage(StageState.GONE, error="its process killed by SIGKILL; loading"), 10.0,
     "its process killed by SIGKILL; loading"),  # its LocalCluster saw the process end
])
def test_lost_reason_is_the_one_place_a_stage_is_judged_lost(info, now, want):
    assert lost_reason(info, now, window_s=5.0, stuck_s=300.0) == want


@pytest.mark.parametrize("state, alive", [
    (StageState.SPARE, True), (StageState.LOADING, True), (StageState.READY, True), (StageState.FAILED, True),
    (StageState.GONE, False), (StageState.LOST, False), (StageState.RESET, False),
])
def test_which_states_are_still_members_of_the_cluster(state, alive):
    assert state.alive is alive
