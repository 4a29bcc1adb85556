"""`--weights`: which format a stage settles on, and shards that hold their projections in blocks, which compute
what transformers computes with the same blocks. tests/cluster/test_weights.py runs quantized stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.models.model_files import open_model_dir
from layerbus.models.weight_blocks import dequantize, quantize
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.packed_linear import PackedLinear
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import WeightChoice, choose_weights
from tests.helpers.equivalence import TINY_PROMPTS


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
