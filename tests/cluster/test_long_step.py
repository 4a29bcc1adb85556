"""A stage busy in one step for longer than its broker timeout stays: the broker's heartbeats that
waited in its socket meanwhile count (stages/worker.py _loop). It used to judge the broker silent
from before the step and leave, and the job re-planned without it."""

from __future__ import annotations

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig


def test_a_step_longer_than_the_broker_timeout_does_not_make_the_stage_leave(tiny_models, tmp_path):
    model_dir = tiny_models("llama", num_hidden_layers=4)
    requests = [GenerationRequest(f"r{i}", [5 + i, 17, 33], max_new_tokens=5) for i in range(2)]
    config = BrokerConfig(str(model_dir), 2, partition="equal",
                          batching=BatchingConfig(num_slots=2, num_micro_batches=1, max_step_tokens=16))
    # stage-1: from its 5th step on, each step takes 2000x its time (milliseconds -> seconds), past its
    # 1 s broker timeout; the broker's own patience for a step (stuck_step_s) is minutes.
    slow = ("--broker-timeout", "1", "--emulate-slowdown", "4:0.0005")
    options = LocalStageOptions(threads_per_stage=1, log_dir=tmp_path, stage_args=((), slow))
    with LocalCluster(config, options) as cluster:
        results, stats = cluster.broker.generate(requests)
        chain = {stage.name: stage.stats.get("steps", 0) for stage in cluster.broker.chain}
    log = (tmp_path / "stage-1.log").read_text() if (tmp_path / "stage-1.log").exists() else ""
    assert "silent" not in log, log
    assert not stats.recoveries and all(len(r.token_ids) == 5 for r in results)
    assert set(chain) == {"stage-0", "stage-1"} and chain["stage-1"] >= 4
