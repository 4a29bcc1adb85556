"""`--weights`: which format a stage settles on, shards that hold their projections in blocks, and the
pipeline equivalence of quantized weights (N stages produce what 1 stage produces in the same format)."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.broker import BrokerConfig
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig
from layerbus.models.model_files import open_model_dir
from layerbus.models.weight_blocks import dequantize, quantize
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.packed_linear import PackedLinear
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import WeightChoice, choose_weights
from tests.helpers.equivalence import TINY_PROMPTS, run_pipeline


@pytest.mark.parametrize("stage_flag, broker_flag, dtype, expected", [
    (None, "auto", "float32", WeightChoice("auto", "float32", None)),
    (None, "auto", "bfloat16", WeightChoice("auto", "bfloat16", None)),
    (None, "int4", "float32", WeightChoice("int4", "float32", "q4_1")),
    (None, "int8", "bfloat16", WeightChoice("int8", "bfloat16", "q8_0")),
    ("int8", "int4", "float32", WeightChoice("int8", "float32", "q8_0")),  # the stage's own flag wins
    ("fp32", "int4", "bfloat16", WeightChoice("fp32", "float32", None)),
    (None, "bf16", "float32", WeightChoice("bf16", "bfloat16", None)),
    (None, "native", "float32", WeightChoice("native", "float32", None)),
])
def test_choose_weights(stage_flag, broker_flag, dtype, expected):
    assert choose_weights(stage_flag, broker_flag, dtype) == expected


def test_choose_weights_names_the_choices():
    with pytest.raises(ValueError, match="'int3' is not one of auto, native"):
        choose_weights(None, "int3", "float32")


@pytest.mark.parametrize("choice, layouts, reported", [
    (WeightChoice("auto", "float32", None), None, "fp32"),
    (WeightChoice("int4", "float32", "q4_1"), "q4_1", "int4 (q4_1 g32)"),
    (WeightChoice("bf16", "bfloat16", None), None, "bf16"),
    (WeightChoice("native", "float32", None), "q4_1, q8_0", "native (q4_1, q8_0 g32)"),
    (WeightChoice("native", "float32", None), None, "fp32"),  # a plain safetensors checkpoint
])
def test_reported_format(choice, layouts, reported):
    assert choice.describe(layouts) == reported


def _reference_with_blocks(model_dir, layout: str):
    """transformers' own model with every decoder-layer Linear weight replaced by its blocks, dequantized."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(dequantize(quantize(module.weight, layout)))
    return model


@pytest.mark.parametrize("layout", ["q8_0", "q4_1"])
def test_packed_shards_match_transformers_with_the_same_blocks(tiny_models, layout):
    """Two shards holding blocks compute the logits of transformers' forward over the dequantized
    blocks, and hold a fraction of the full-precision bytes."""
    model_dir = tiny_models("qwen2", num_hidden_layers=4)
    files = open_model_dir(model_dir)
    spans = [LayerRange(0, 1), LayerRange(1, 4)]
    shards = [load_shard(files, ShardSpec(span, i == 0, i == 1, quantize_to=layout)) for i, span in enumerate(spans)]
    full = [load_shard(files, ShardSpec(span, i == 0, i == 1)) for i, span in enumerate(spans)]
    packed = [m for shard in shards for m in shard.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * 7 and all(m.layout.name == layout for m in packed)
    assert not any(type(m) is nn.Linear for shard in shards for m in shard.layers.modules())
    linear_bytes = sum(m.weight.numel() * 4 for shard in full for m in shard.layers.modules() if type(m) is nn.Linear)
    assert sum(m.weight_bytes() for m in packed) == linear_bytes * {"q8_0": 34, "q4_1": 20}[layout] // 128
    assert sum(s.parameter_bytes() for s in shards) < sum(s.parameter_bytes() for s in full)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(TINY_PROMPTS[1]).input_ids
    config = files.config
    arenas = [KVArena(list(span), 1, config.num_key_value_heads, config.head_dim, torch.float32,
                      torch.device("cpu"), 128) for span in spans]
    hidden = torch.tensor(ids)
    for shard, arena in zip(shards, arenas):
        hidden = run_step(shard, arena, [StepRow(0, 0, len(ids))], hidden)
    logits = head_logits(shards[-1], hidden)
    with torch.no_grad():
        expected = _reference_with_blocks(model_dir, layout)(torch.tensor([ids])).logits[0]
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert (logits - plain).abs().max() > 1e-3, "the blocks should differ from the full-precision weights"


def test_odd_input_width_names_the_way_out(tiny_models):
    model_dir = tiny_models("llama", hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="48 input channels, not a multiple of 32.*--weights fp32"):
        load_shard(open_model_dir(model_dir), ShardSpec(LayerRange(0, 1), True, False, quantize_to="q4_1"))


def _requests(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [GenerationRequest(f"p{i}", tokenizer(p).input_ids, max_new_tokens=6 + (i * 5) % 17)
            for i, p in enumerate(TINY_PROMPTS)]


@pytest.fixture(scope="module")
def one_stage_outputs(tiny_models):
    """Each format's outputs on 1 stage: the reference its 2- and 3-stage runs must equal."""
    outputs = {}

    def get(weights: str) -> list[list[int]]:
        if weights not in outputs:
            model_dir = tiny_models("llama", num_hidden_layers=4)
            results, _ = run_pipeline(model_dir, 1, _requests(model_dir), num_slots=4, max_step_tokens=16,
                                      min_prefill_chunk=8, weights=weights)
            outputs[weights] = [r.token_ids for r in results]
        return outputs[weights]

    return get


@pytest.mark.cluster
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_stages_match_one_stage(tiny_models, one_stage_outputs, weights, num_stages):
    """Every one of the N stages holds the format and takes part: the split is pinned (equal), since on a
    2-core machine the planner may rightly leave stages of a 4-layer model out (a CI run dropped 2 of 3)."""
    model_dir = tiny_models("llama", num_hidden_layers=4)
    reported = []
    results, stats = run_pipeline(model_dir, num_stages, _requests(model_dir), num_slots=4, max_step_tokens=16,
                                  min_prefill_chunk=8, weights=weights, partition="equal",
                                  check=lambda broker: reported.extend(s.weights for s in broker.chain))
    assert all(r.error is None for r in results)
    assert [r.token_ids for r in results] == one_stage_outputs(weights)
    layout = {"int8": "q8_0", "int4": "q4_1"}[weights]
    assert reported == [f"{weights} ({layout} g32)"] * num_stages
    assert stats.finished == len(results)


@pytest.mark.cluster
def test_quantized_one_stage_differs_from_full_precision(tiny_models, one_stage_outputs):
    """The formats really change the weights: int4 on one stage does not generate exactly what fp32 does."""
    assert one_stage_outputs("int4") != one_stage_outputs("auto")


@pytest.mark.cluster
def test_a_stage_s_own_weights_flag_wins(tiny_models):
    model_dir = tiny_models("llama", num_hidden_layers=4)
    config = BrokerConfig(str(model_dir), 2, weights="int8", partition="equal",
                          batching=BatchingConfig(num_slots=2))
    options = LocalStageOptions(threads_per_stage=1, stage_args=(("--weights", "int4"),))
    with LocalCluster(config, options) as cluster:
        reported = {stage.name: (stage.weights, stage.param_bytes) for stage in cluster.broker.chain}
    assert reported["stage-0"][0] == "int4 (q4_1 g32)"
    assert reported["stage-1"][0] == "int8 (q8_0 g32)"


@pytest.mark.cluster
def test_run_weights_flag_and_status_json_stages(tmp_path, tiny_models):
    """`layerbus run --weights int4`: `status --json` lists every stage's span, host, format and weight bytes."""
    from tests.helpers.cli import JOB_ID, layerbus, status_json, write_jsonl

    home = tmp_path / "home"
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": f"doc-{i}", "text": f"Batch {i}."} for i in range(3)])
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    result = layerbus(home, "run", corpus, "--task", "summarize", "--model", tiny_models("llama"), "--stages", "2",
                      "--db", db, "--max-new-tokens", "4", "--max-context", "128", "--weights", "int4",
                      "--partition", "balanced", timeout=120)
    assert result.returncode == 0, result.stderr
    stages = status_json(home, JOB_ID.search(result.stdout).group(), "--db", db)["stages"]
    assert sorted(s["name"] for s in stages) == ["stage-0", "stage-1"]
    assert [s["layers"] for s in stages] == ["[0, 2)", "[2, 4)"]
    assert all(s["weights"] == "int4 (q4_1 g32)" and s["weight_bytes"] > 0 for s in stages)
    assert all(s["host"] == socket.gethostname() for s in stages)  # as each stage registered


@pytest.mark.cluster
@pytest.mark.slow
def test_native_default_model_matches_its_float32_import(smollm2_case):
    """--weights native on the default model runs on the GGUF's own Q4_1 (and Q8_0 embedding) blocks and
    generates token for token what transformers generates on the float32 import, on 3 stages that hold
    together under a quarter of the float32 model's 538,060,032 bytes (the tied head is held twice: by
    the first stage as its embedding, by the last as its head)."""
    model_dir, model, requests, references = smollm2_case
    loaded = []
    results, _ = run_pipeline(model_dir, 3, requests, num_slots=4, max_step_tokens=64, weights="native",
                              check=lambda broker: loaded.extend((s.weights, s.param_bytes) for s in broker.chain))
    assert [r.error for r in results] == [None] * len(results)
    assert [r.token_ids for r in results] == references
    assert {weights for weights, _ in loaded} <= {"native (q4_1, q8_0 g32)", "native (q4_1 g32)"}
    assert sum(size for _, size in loaded) < 0.24 * 538_060_032
