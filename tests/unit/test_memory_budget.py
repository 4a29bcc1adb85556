"""A --memory-budget is the stage's whole memory: its runtime (measured at start) and its loader's
temporary come out of it before the planner fits weights, KV cache and workspace, so the stage's
peak resident memory (VmHWM) stays within it. --emulate-memory keeps the old meaning, for
emulating a smaller device."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from layerbus.broker.broker import BatchingConfig, BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.requests import GenerationRequest
from layerbus.models.model_files import open_model_dir
from layerbus.stages.host import budget_overrun
from layerbus.stages.profile import largest_tensor_bytes, memory_figures
from layerbus.wire.spans import LayerRange
from tests.helpers.equivalence import TINY_PROMPTS
from tests.helpers.memory import vm_hwm

MIB = 1 << 20


@pytest.mark.parametrize("device, given, emulated, usable", [
    # A CPU budget: runtime (400 MiB) and loader (L) come out of it.
    ("cpu", 1000 * MIB, None, "1000 MiB - 400 MiB - L"),
    # Too small for the runtime alone: nothing is left, never a negative budget.
    ("cpu", 300 * MIB, None, "0"),
    # An emulated device: as given, nothing subtracted.
    ("cpu", None, 5 * MIB, "5 MiB"),
    ("cpu", 1000 * MIB, 5 * MIB, "5 MiB"),
])
def test_memory_figures(tiny_models, device, given, emulated, usable):
    files = open_model_dir(tiny_models("llama"))
    loader = largest_tensor_bytes(files)
    want = eval(usable.replace("MiB", "* MIB").replace("L", "loader"))  # noqa: S307 - the table's own arithmetic
    figures = memory_figures(files, device, given, 400 * MIB, emulated)
    assert figures["memory_budget"] == max(0, want)


def test_without_a_budget_only_the_loader_comes_out_of_free_memory(tiny_models):
    files = open_model_dir(tiny_models("llama"))
    figures = memory_figures(files, "cpu", None, 400 * MIB)
    assert figures["runtime_bytes"] == 400 * MIB and figures["loader_peak_bytes"] == largest_tensor_bytes(files) > 0
    assert figures["memory_budget"] > 0 and figures["memory_budget_given"] is None


@pytest.mark.parametrize("peak, budget, said", [
    (1100 * MIB, 1150 * MIB, None),  # within
    (1150 * MIB, 1150 * MIB, None),  # exactly the budget is within it
    (1224 * MIB, None, None),  # no --memory-budget: nothing promised
    (1224 * MIB, 1150 * MIB, "1224 MiB is over the --memory-budget of 1150 MiB by 74 MiB (before the load 406 MiB, "
                             "weights 652 MiB, the rest 166 MiB"),
])
def test_a_load_over_its_budget_is_named_with_where_the_memory_went(peak, budget, said):
    message = budget_overrun(peak, budget, before_load_bytes=406 * MIB, weight_bytes=652 * MIB)
    if said is None:
        assert message is None
    else:
        assert said in message and "more --memory-budget" in message


@pytest.mark.cluster
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
