"""A real stage process on a --memory-budget that just fits its span keeps its peak resident memory since the
load (VmHWM) within the budget while it serves a job."""

from __future__ import annotations

from transformers import AutoTokenizer

from layerbus.broker.broker import BatchingConfig, BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.requests import GenerationRequest
from layerbus.wire.spans import LayerRange
from tests.helpers.equivalence import TINY_PROMPTS
from tests.helpers.memory import MIB, vm_hwm


def test_a_stage_s_peak_resident_memory_stays_within_a_budget_that_just_fits(tiny_models):
    """The first stage, with no budget, says what its runtime and loader take and what its span needs;
    the second gets a budget that just fits all of that, holds the whole model, serves a job, and its
    peak resident memory since the load (the stage resets VmHWM when it loads) is within the budget."""
    model_dir = tiny_models("llama", num_hidden_layers=4, hidden_size=256, intermediate_size=1024,
                            num_attention_heads=4, num_key_value_heads=2)
    config = BrokerConfig(str(model_dir), 1, batching=BatchingConfig(num_slots=4, max_context=256))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = [GenerationRequest(f"p{i}", tokenizer(p).input_ids, max_new_tokens=8) for i, p in enumerate(TINY_PROMPTS)]
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
        [profile], [placed] = cluster.broker.profiles, cluster.broker.plan.stages
    assert profile.runtime_bytes > 100 * MIB, "the interpreter and torch at least"
    need = placed.weight_bytes + placed.kv_bytes + placed.workspace_bytes
    # The 5% reserve is of what is left for the planner; 32 MiB for the second process's runtime differing.
    budget = profile.runtime_bytes + profile.loader_bytes + int(need / 0.95) + 32 * MIB

    options = LocalStageOptions(threads_per_stage=1, stage_args=(("--memory-budget", str(budget)),))
    with LocalCluster(config, options) as cluster:
        [placed] = cluster.broker.plan.stages
        assert placed.layers == LayerRange(0, 4) and placed.memory_budget < budget - profile.runtime_bytes // 2
        results, _ = cluster.broker.generate(requests)
        peak = vm_hwm(cluster.broker.chain[0].pid)
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:2]
    assert peak <= budget, f"peak resident memory {peak / MIB:.0f} MiB over the budget {budget / MIB:.0f} MiB"
