"""The co-run probe in step: a ring of one micro-batch per stage starts the
steps of a host's stages together and waits for the last to finish; the stages measure that
(`stages.corun_probe.tick_probe`), and the plan prices each step that much longer (`window_pricing.window_s`)
where the ring keeps them in step."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from layerbus.planner.window_pricing import Neighbour, window_s
from layerbus.planner.plan_values import StageProfile
from layerbus.planner.step_cost import StepWork
from layerbus.planner.workload import Window
from layerbus.stages.corun_probe import tick_probe
from layerbus.stages.profile_request import ProfileRequest
from layerbus.wire.frames import WireError

HEADER = {"model_dir": "/m", "micro_batch_size": 8, "kv_length": 64, "prefill_tokens": 32, "probe_s": 1.0}


def test_a_step_whose_tick_has_passed_is_left_out_and_the_rest_are_reported_by_tick() -> None:
    served = []
    # Ticks a second apart from 10.5 s ago: ticks 0-10 have passed; tick 11 comes in half a second.
    request = ProfileRequest.from_header({**HEADER, "probe_s": 12.0, "tick_start": time.time() - 10.5,
                                          "tick_period_s": 1.0, "tick_layers": 12})
    result = tick_probe(lambda: served.append(1) or 0.001, request, repeats=3)
    assert [tick for tick, _ in result["probe_ticks"]] == [11] and result["probe_tick_repeats"] == 3
    assert len(served) == 1 + 3, "a step to warm up, then the repeats of the one tick that came"


@pytest.mark.parametrize("fields", [{"tick_period_s": -1.0}, {"tick_period_s": 61.0}, {"tick_layers": 2.5},
                                    {"tick_start": "soon"}, {"tick_layers": True}, {"probe_start": -3}])
def test_a_malformed_probe_in_step_is_refused(fields) -> None:
    with pytest.raises(WireError, match="tick_start, tick_period_s"):
        ProfileRequest.from_header({**HEADER, **fields})


def test_a_profile_request_without_ticks_is_a_probe_at_its_own_pace() -> None:
    request = ProfileRequest.from_header(dict(HEADER, weights="int8"))
    assert (request.tick_period_s, request.tick_layers, request.probe_start, request.weights) == (0.0, 0, 0.0, "int8")


def test_stages_probed_together_start_serving_at_one_time() -> None:
    request = ProfileRequest.from_header({**HEADER, "probe_start": 1234.5})
    assert request.probe_start == 1234.5 and request.tick_period_s == 0


def cpu_stage(name: str, excess: float) -> StageProfile:
    return StageProfile(name, 1e-3, 1e-2, 1e-4, 1e-3, 1 << 30, host="box", host_cores=2, threads=1,
                        corun_factor=1.5, lockstep_excess_s=excess)


WINDOW = Window(StepWork(steps=100), 100.0, 1.0)
ALONE = [2.0, 2.0, 1.5]  # seconds each stage computes in the window's 100 steps, alone


@pytest.mark.parametrize("micro_batches, neighbours, in_step", [
    (3, (), True), (4, (), True),  # one per stage, and one more at the broker: the ring keeps them in step
    (5, (), False),  # a micro-batch queued at every stage: each serves at its own pace
    (3, (Neighbour(replace(cpu_stage("other", 0.0), name="other"), 0.5, 0.5),), False),  # another chain's there too
])
def test_the_ring_waits_each_step_for_the_host_s_last_stage(micro_batches, neighbours, in_step) -> None:
    chain = [cpu_stage(f"s{k}", 0.004) for k in range(3)]
    time_s, busy = window_s(ALONE, chain, WINDOW, micro_batches, neighbours=neighbours)
    paced_s, paced_busy = window_s(ALONE, [replace(s, lockstep_excess_s=0.0) for s in chain], WINDOW, micro_batches,
                                   neighbours=neighbours)
    if in_step:
        # Started together, each computes while the others do: stretched by the whole co-run factor (3
        # one-thread stages on 2 cores: 1.5x), however idle the ring leaves them; the window lasts the
        # busiest stage's seconds and 4 ms more each of its 100 steps.
        assert busy == [pytest.approx(a * 1.5) for a in ALONE]
        assert time_s == pytest.approx(max(busy) + 100 * 0.004) and time_s > paced_s
    else:
        assert (time_s, busy) == (paced_s, paced_busy)


def test_stages_on_hosts_of_their_own_are_not_in_step_with_anyone() -> None:
    chain = [replace(cpu_stage(f"s{k}", 0.004), host=f"box{k}") for k in range(3)]
    assert window_s(ALONE, chain, WINDOW, 3) == window_s(ALONE, [replace(s, lockstep_excess_s=0.0) for s in chain],
                                                         WINDOW, 3)


@pytest.mark.parametrize("offset_s, lead_s, moved", [
    (0.0, 0.3, False),  # the broker's clock is this host's: the start as given
    (0.2, 0.3, False),  # a clock in sync to within a fraction of a second: as given
    (100.0, 0.3, True), (-100.0, 0.3, True),  # another machine's clock, far off either way: the lead from now
    (100.0, 0.0, False),  # no lead said (a broker of before): as given
], ids=["same clock", "in sync", "ahead", "behind", "no lead"])
def test_a_start_on_another_machine_s_clock_is_taken_as_the_lead_from_now(offset_s, lead_s, moved) -> None:
    from layerbus.stages.corun_probe import on_this_clock

    for fields in ({"probe_start": 1.0}, {"tick_start": 1.0, "tick_period_s": 0.1, "tick_layers": 4}):
        given = time.time() + lead_s + offset_s
        name = next(iter(fields))
        request = ProfileRequest(**{**{k: v for k, v in HEADER.items()}, **fields, name: given, "start_lead_s": lead_s})
        before = time.time()
        start = getattr(on_this_clock(request), name)
        if moved:
            assert before + lead_s <= start <= time.time() + lead_s
        else:
            assert start == given


def test_a_start_more_than_a_minute_ahead_without_a_lead_is_refused() -> None:
    with pytest.raises(WireError, match="at most 60 s ahead"):
        ProfileRequest.from_header({**HEADER, "probe_start": time.time() + 3600})
    assert ProfileRequest.from_header({**HEADER, "probe_start": time.time() + 3600, "start_lead_s": 0.3}).start_lead_s \
        == 0.3  # with a lead the stage starts that long after the request, whatever the broker's clock says
