"""Planning a job takes seconds on a busy machine; the stages waiting for their spans must keep hearing the
broker meanwhile, or each leaves after its --broker-timeout (15 s) and the start turns into restarts (seen on
the README's command under load: planning took 11-16 s)."""

from __future__ import annotations

import time

import layerbus.broker.chain_keeper as keeper_module
from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig

SLOW_PLAN_S = 5.0  # longer than the stages' broker timeout below
STAGE_BROKER_TIMEOUT_S = 2


def test_stages_keep_hearing_the_broker_while_it_plans(tiny_models, monkeypatch):
    real_plan_chain = keeper_module.plan_chain

    def slow_plan_chain(*args, **kwargs):
        time.sleep(SLOW_PLAN_S)
        return real_plan_chain(*args, **kwargs)

    monkeypatch.setattr(keeper_module, "plan_chain", slow_plan_chain)
    model_dir = tiny_models("llama", num_hidden_layers=4)
    config = BrokerConfig(str(model_dir), 2, batching=BatchingConfig(micro_batch_size=0, max_step_tokens=0))
    timeout = ("--broker-timeout", str(STAGE_BROKER_TIMEOUT_S))
    options = LocalStageOptions(threads_per_stage=1, stage_args=(timeout, timeout))
    with LocalCluster(config, options) as cluster:
        assert cluster.broker.start_events == [], cluster.broker.start_events  # no stage left, none restarted
        results, _ = cluster.broker.generate([GenerationRequest("a", [1, 2, 3, 4], max_new_tokens=3)])
    assert results[0].error is None and results[0].token_ids
