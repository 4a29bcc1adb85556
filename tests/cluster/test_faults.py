"""Surviving faults with real stage processes and real signals: a killed stage, a stopped one, a
poison item. Outputs must equal an unfaulted run's, token for token, with every request answered once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from layerbus.planner.drift import DriftConfig
from layerbus.broker.profiling import ProfilingConfig
from layerbus.broker.pipeline import PipelineConfig
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig
from tests.helpers.faulted_runs import kill_middle_after, make_requests, outputs, process_of, run


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama", num_hidden_layers=6)


@pytest.fixture(scope="module")
def requests(model_dir):
    return make_requests(model_dir)


@pytest.fixture(scope="module")
def long_requests(model_dir):
    """40 requests, the first 24 of them `requests`: the SIGSTOP test needs a longer run to recover in."""
    return make_requests(model_dir, count=40)


@pytest.fixture(scope="module")
def unfaulted_long(model_dir, long_requests):
    """The unfaulted outputs of all 40 requests: one run serves every test's reference."""
    results, stats = run(model_dir, long_requests)
    assert stats.recoveries == []
    return {rid: result.token_ids for rid, result in results.items()}


@pytest.fixture(scope="module")
def unfaulted(requests, unfaulted_long):
    """The unfaulted outputs of `requests`."""
    return {request.request_id: unfaulted_long[request.request_id] for request in requests}


def test_kill_9_of_one_of_three_stages_changes_no_output(model_dir, requests, unfaulted):
    killed = []
    kill_middle = kill_middle_after(4, killed)
    events, counts = [], []
    # In their order, the survivors keep what they held: the replay below depends on it.
    results, stats = run(model_dir, requests, on_result=kill_middle, events=events, counts=counts, reorder=False)
    assert killed, "the run ended before the fault was injected: make it longer"
    assert len(stats.recoveries) == 1 and stats.recoveries[0]["stage"] == killed[0]
    assert (counts[0].stages_lost, counts[0].replans_lost, counts[0].replans_slowed) == (1, 1, 0)
    assert [kind for kind, _, _ in events][:2] == ["stage_lost", "recovered"]
    # The survivors kept the caches of the layers they held before: only the lost stage's layers (and,
    # at most, the ones between them and a kept input) were recomputed, not all six.
    window = stats.recoveries[0]["replay_layers"]
    lost_span = stats.recoveries[0]["lost_span"]
    assert window is not None and window[0] <= lost_span[0] and lost_span[1] <= window[1] and window != [0, 6], \
        (window, lost_span)
    assert outputs(results) == unfaulted


def test_every_layer_is_recomputed_when_caches_are_not_kept(model_dir, requests, unfaulted):
    killed: list[str] = []
    results, stats = run(model_dir, requests, on_result=kill_middle_after(4, killed),
                         batching=BatchingConfig(num_slots=8, num_micro_batches=4, max_step_tokens=32, keep_caches=False))
    assert killed and len(stats.recoveries) == 1
    assert stats.recoveries[0]["replay_layers"] == [0, 6]
    assert outputs(results) == unfaulted


def test_sigstop_beyond_the_liveness_window_is_recovered_and_late_results_are_discarded(model_dir, long_requests,
                                                                                       unfaulted_long):
    stopped = []

    def stop_last(cluster, count):
        if count >= 4 and not stopped:
            process, name = process_of(cluster, -1)
            stopped.extend([process.pid, name])
            os.kill(process.pid, signal.SIGSTOP)
        elif len(stopped) == 2 and stopped[1] not in cluster.broker.placement.stages:
            stopped.append("continued")  # re-planned without it: let it run its stale steps now
            os.kill(stopped[0], signal.SIGCONT)

    results, stats = run(model_dir, long_requests, on_result=stop_last)
    try:
        assert len(stopped) == 3, "recovery did not happen while the run lasted"
        # One re-plan for the loss; the stage, continued, may register again and be grown back in while the run
        # lasts (a "joined" re-plan), depending on how long the rest of the run takes.
        lost = [event for event in stats.recoveries if event["reason"] != "joined"]
        assert len(lost) == 1 and lost[0]["stage"] == stopped[1], stats.recoveries
        assert all(event["stage"] == stopped[1] for event in stats.recoveries[1:]), stats.recoveries
        # Run after SIGCONT, the last stage's queued steps of the old epoch reach the broker and are dropped.
        assert stats.discarded >= 1
        assert outputs(results) == unfaulted_long
    finally:
        if stopped:
            try:
                os.kill(stopped[0], signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_a_poison_item_fails_after_bounded_attempts_and_the_rest_complete(model_dir, requests, unfaulted):
    used = {token for request in requests for token in request.prompt_ids} | {t for out in unfaulted.values() for t in out}
    poison_id = next(token for token in range(3, 10_000) if token not in used)  # a token no other item sees
    poisoned = list(requests)
    poisoned.insert(5, GenerationRequest("poison", [1, 2, poison_id, 3], max_new_tokens=10))
    counts = []
    results, stats = run(model_dir, poisoned, env={"LAYERBUS_FAIL_ON_TOKEN": str(poison_id)}, counts=counts)
    assert counts[0].failed_steps >= 3 and counts[0].stages_lost == 0, counts
    poison = results.pop("poison")
    assert poison.finish_reason == "error"
    assert "LAYERBUS_FAIL_ON_TOKEN" in poison.error and "failed alone 3 time(s)" in poison.error
    assert outputs(results) == unfaulted


def test_a_stage_slowed_mid_job_has_layers_moved_off_it_and_outputs_do_not_change(tiny_models):
    """stage-1 runs at a tenth of its speed after 150 steps: the broker sees it drift from its
    measured normal, re-plans with its profile slowed as much, and moves layers off it."""
    events, initial = [], {}

    def note_initial_spans(cluster, count):
        if not initial:
            initial.update(zip(cluster.broker.placement.stages, cluster.broker.placement.spans))

    watchful = PipelineConfig(heartbeat_interval_s=0.2, liveness_window_s=3.0,
                              drift=DriftConfig(window_s=1.0, windows=2, min_steps=4, watch_shared_cpu_host=True))
    slow_later = ((), ("--emulate-slowdown", "150:0.1"), ())
    model_dir = tiny_models("llama", num_hidden_layers=12)  # several layers per stage, so some can move
    # 24 x 60 tokens: about 720 steps, so some 570 at the slowed pace if never re-planned (about 27 s),
    # where the baseline window and two slow windows take about 3 s.
    long_run = make_requests(model_dir, count=24, max_new_tokens=60)
    counts = []
    # No co-run probe: the sharing is reckoned from threads and cores, so the first plan spreads the layers.
    # A probe taken while CI loaded the machine read factors high enough that the first plan put 10 of 12
    # layers on stage-0 and 1 on stage-1, which then had none to give up when slowed ("no other placement
    # is faster"); what is tested here is the drift watch and the re-plan, not the probe.
    results, stats = run(model_dir, long_run, events=events, pipeline=watchful, stage_args=slow_later,
                         on_result=note_initial_spans, counts=counts, profiling=ProfilingConfig(probe_s=0))
    assert "rebalanced" in [kind for kind, _, _ in events], f"no re-plan after the slowdown; events: {events}"
    assert counts[0].replans_slowed == [kind for kind, _, _ in events].count("rebalanced") >= 1
    # The re-plan for stage-1, against the placement it replaced. Another stage slowed by the load of a
    # loaded machine (CI once saw stage-2 3.7x slower for a while) is re-planned too, as it should be:
    # that one is not what is tested.
    placements = [initial] + [dict(zip(r["placement"].stages, r["placement"].spans)) for r in stats.recoveries]
    slowed = [k for k, r in enumerate(stats.recoveries) if "stage-1" in r["stage"].split(",")]
    assert slowed, f"no re-plan for stage-1; re-plans for {[r['stage'] for r in stats.recoveries]}; events: {events}"
    before, after = placements[slowed[0]], placements[slowed[0] + 1]
    assert "stage-1" not in after or len(after["stage-1"]) < len(before["stage-1"]), (before, after)
    reference, _ = run(model_dir, long_run)
    assert outputs(results) == outputs(reference)


def test_survivors_too_small_for_the_model_wait_for_a_stage_to_join(model_dir, requests, unfaulted):
    """Each stage's --memory-budget holds a third of the model: after a kill, the two survivors cannot
    hold it, the job waits (and says why) instead of failing, and goes on when a new stage registers."""
    from layerbus.planner.model_memory import model_memory
    from layerbus.planner.placement import PlacementError, PlanOptions, StageProfile, plan_placement
    from layerbus.models.model_files import open_model_dir

    batching = BatchingConfig(num_slots=8, num_micro_batches=4, max_step_tokens=32, max_context=128)
    memory = model_memory(open_model_dir(model_dir))

    def fits(budget: int, stages: int) -> bool:
        profiles = [StageProfile(f"s{i}", 1e-3, 1e-2, 1e-4, 1e-3, budget) for i in range(stages)]
        try:
            # In full precision, as the job starts (under --weights auto the planner could fit int8 in less,
            # and the broker keeps the first placement's precision when it re-plans: it waits instead).
            return len(plan_placement(profiles, memory, batching, PlanOptions(max_auto_level=0)).order) == stages
        except PlacementError:
            return False

    budget = next(b for b in range(1 << 16, 1 << 32, 1 << 14) if fits(b, 3))
    assert not fits(budget, 2), "the budget must be too small for two stages"
    budget_args = ("--emulate-memory", str(budget))
    events, joined = [], []

    def kill_then_replace(cluster, count):
        if count >= 4 and not joined:
            process, name = process_of(cluster, 1)
            os.kill(process.pid, signal.SIGKILL)
            joined.append(subprocess.Popen([sys.executable, "-m", "layerbus.stages", "--broker", cluster.broker.address,
                                            "--name", "stage-new", "--threads", "1", *budget_args],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    try:
        # The joining stage is started by hand, as on another machine, with no keys: this cluster runs
        # without CurveZMQ (a secured one refuses it; tests/cluster/test_security.py covers that).
        results, stats = run(model_dir, requests, events=events, on_result=kill_then_replace, batching=batching,
                             stage_args=(budget_args,) * 3, secure=False)
    finally:
        for process in joined:
            process.terminate()
            process.wait(10)
    kinds = [kind for kind, _, _ in events]
    assert "waiting" in kinds and kinds.index("waiting") < kinds.index("recovered"), events
    waiting = next(message for kind, message, _ in events if kind == "waiting")
    assert "cannot hold" in waiting and "layerbus stage --broker" in waiting
    assert "stage-new" in stats.recoveries[-1]["placement"].stages
    assert outputs(results) == unfaulted


def test_a_step_not_back_in_time_is_resent_and_the_late_duplicate_discarded(model_dir, requests, unfaulted):
    """A stage paused for less than the liveness window but longer than the step timeout: its steps
    are resent with the next attempt number, the first attempts' results are discarded as duplicates,
    and no stage is declared lost."""
    paused = []

    def pause_middle(cluster, count):
        if count >= 4 and not paused:
            process, name = process_of(cluster, 1)
            paused.append(name)
            os.kill(process.pid, signal.SIGSTOP)
            # Stopped for 2 s: past the step timeout, well within the liveness window.
            threading.Timer(2.0, os.kill, (process.pid, signal.SIGCONT)).start()

    impatient = PipelineConfig(heartbeat_interval_s=0.2, liveness_window_s=5.0, step_timeout_s=1.0)
    counts = []
    results, stats = run(model_dir, requests, on_result=pause_middle, pipeline=impatient, counts=counts)
    assert paused and stats.recoveries == []
    assert stats.resent >= 1 and stats.discarded >= 1
    assert counts[0].resent_steps == stats.resent and counts[0].stages_lost == 0
    assert outputs(results) == unfaulted
