"""Start-up that survives, with real stage processes and real signals: a local stage killed before it
registers, or while it loads its span, is named with why, restarted a bounded number of times, or left
out; the run goes on and its outputs equal an unfaulted run's, token for token."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from layerbus.broker.broker import BrokerConfig
from layerbus.broker.control import StageState
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.pipeline import PipelineConfig
from layerbus.planner.batching import BatchingConfig
from tests.helpers.faulted_runs import make_requests, outputs

BATCHING = BatchingConfig(num_slots=8, num_micro_batches=4, max_step_tokens=32)
# "equal" places without profiling: the faults hit start-up itself, and each start costs less.
CONFIG = dict(partition="equal", batching=BATCHING, pipeline=PipelineConfig(heartbeat_interval_s=0.2),
              register_timeout_s=300.0)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama", num_hidden_layers=6)


@pytest.fixture(scope="module")
def requests(model_dir):
    return make_requests(model_dir, count=12, max_new_tokens=24)


@pytest.fixture(scope="module")
def unfaulted(model_dir, requests):
    with LocalCluster(BrokerConfig(str(model_dir), 3, **CONFIG), LocalStageOptions(threads_per_stage=1)) as cluster:
        results, _ = cluster.broker.generate(requests)
        assert cluster.broker.start_events == []
    return outputs({r.request_id: r for r in results})


def run_with_fault(cluster: LocalCluster, requests, fault=lambda cluster: None, during_start=None) -> dict:
    """Spawn the stages, inject `fault(cluster)`, start the broker (with `during_start(cluster)` running in a
    thread meanwhile), run the requests, stop everything; what the test looks at."""
    helper = None
    try:
        cluster.spawn()
        fault(cluster)
        if during_start is not None:
            helper = threading.Thread(target=during_start, args=(cluster,))
            helper.start()
        cluster.start()
        results, _ = cluster.broker.generate(requests)
        return {"outputs": outputs({r.request_id: r for r in results}), "events": cluster.broker.start_events,
                "chain": list(cluster.broker.placement.stages),
                "registered": {stage.name for stage in cluster.broker.control.stages.values()}}
    finally:
        if helper is not None:
            helper.join()
        cluster.close()


def test_a_stage_killed_before_it_registers_is_restarted_and_the_run_has_every_stage(model_dir, requests, unfaulted,
                                                                                   tmp_path):
    cluster = LocalCluster(BrokerConfig(str(model_dir), 3, **CONFIG),
                           LocalStageOptions(threads_per_stage=1, log_dir=tmp_path, max_restarts=2, fork=False))
    killed = []

    def kill_stage_1(cluster):
        # A fresh interpreter (fork=False), just started: it has not even imported torch, so the kill
        # lands before it registers (a stage forked from the launcher registers within milliseconds).
        killed.append(cluster.processes[1].pid)
        os.kill(killed[0], signal.SIGKILL)

    run = run_with_fault(cluster, requests, kill_stage_1)
    events = run["events"]
    assert [kind for kind, _ in events] == ["stage_exited"]
    assert events[0][1].startswith(f"stage stage-1 (pid {killed[0]}) killed by SIGKILL; ")
    assert events[0][1].endswith("; restarted (1 of at most 2)")
    assert sorted(run["chain"]) == ["stage-0", "stage-1", "stage-2"]
    assert run["outputs"] == unfaulted


def test_a_stage_that_cannot_come_back_is_left_out_without_waiting_for_the_register_timeout(model_dir, requests,
                                                                                          unfaulted, tmp_path):
    cluster = LocalCluster(BrokerConfig(str(model_dir), 3, **CONFIG),
                           LocalStageOptions(threads_per_stage=1, log_dir=tmp_path, max_restarts=0, fork=False))
    run = run_with_fault(cluster, requests, lambda cluster: os.kill(cluster.processes[1].pid, signal.SIGKILL))
    events = run["events"]
    assert [kind for kind, _ in events] == ["stage_exited", "placed_fewer"]
    assert "stage stage-1" in events[0][1] and events[0][1].endswith("not restarted: going on without it")
    assert events[1][1].startswith("placed over 2 of 3 stages: stage-1 (pid ")
    assert run["chain"] == ["stage-0", "stage-2"] and "stage-1" not in run["registered"]
    assert run["outputs"] == unfaulted


def test_a_stage_killed_while_loading_its_span_is_restarted_and_the_model_placed_again(model_dir, requests,
                                                                                     unfaulted, tmp_path):
    hold = tmp_path / "hold-loads"
    hold.touch()  # every stage told its span waits while this file exists (LAYERBUS_HOLD_LOAD_WHILE)
    cluster = LocalCluster(BrokerConfig(str(model_dir), 3, **CONFIG),
                           LocalStageOptions(threads_per_stage=1, log_dir=tmp_path, max_restarts=1,
                                             env={"LAYERBUS_HOLD_LOAD_WHILE": str(hold)}))
    killed = []

    def kill_stage_2_mid_load(cluster):
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not killed:
                stage = cluster.broker.control.stages.get(b"stage-2")
                if stage is not None and stage.state is StageState.LOADING:
                    killed.append(stage.pid)
                    os.kill(stage.pid, signal.SIGKILL)
                time.sleep(0.02)
        finally:
            hold.unlink()  # the others (and the restarted stage-2) load now

    run = run_with_fault(cluster, requests, during_start=kill_stage_2_mid_load)
    events = run["events"]
    assert killed, "stage-2 was never seen loading"
    assert [kind for kind, _ in events] == ["stage_exited", "stage_lost"], events
    assert events[0][1].startswith(f"stage stage-2 (pid {killed[0]}) killed by SIGKILL; ")
    assert events[0][1].endswith("; restarted (1 of at most 1)")
    assert events[1][1].startswith("stage stage-2 lost while the model was being placed (its process killed by "
                                   "SIGKILL; ")
    assert sorted(run["chain"]) == ["stage-0", "stage-1", "stage-2"]
    assert run["outputs"] == unfaulted
