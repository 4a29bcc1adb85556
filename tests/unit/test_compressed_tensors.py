"""A compressed-tensors checkpoint (pack-quantized 4-bit groups, made here from a tiny random model with
the library's own packing) loads as Q4_0 blocks, and two stages compute what the library's own
forward (transformers with compressed-tensors decompressing) computes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.models.model_files import ModelDirError, open_model_dir
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.packed_linear import PackedLinear
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from tests.helpers.equivalence import TINY_PROMPTS

pytest.importorskip("compressed_tensors", reason="the compressed-tensors extra: pip install -e '.[compressed-tensors]'")
from tests.helpers.compressed_checkpoint import make_compressed_checkpoint  # noqa: E402  (needs the library)


@pytest.fixture(scope="module")
def compressed_model(tiny_models, tmp_path_factory):
    return make_compressed_checkpoint(tiny_models("llama", num_hidden_layers=4), tmp_path_factory.mktemp("ct") / "ct")


@pytest.mark.parametrize("weights", ["native", "auto"])  # no full-precision projections: its blocks either way
def test_two_stages_compute_the_library_s_own_forward(compressed_model, weights):
    files = open_model_dir(compressed_model)
    spans = [LayerRange(0, 1), LayerRange(1, 4)]
    shards = [load_shard(files, ShardSpec(span, i == 0, i == 1, native=weights == "native"))
              for i, span in enumerate(spans)]
    packed = [m for shard in shards for m in shard.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * 7 and {m.layout.name for m in packed} == {"q4_0"}
    ids = AutoTokenizer.from_pretrained(compressed_model)(TINY_PROMPTS[1]).input_ids
    config = files.config
    hidden = torch.tensor(ids)
    for shard, span in zip(shards, spans):
        arena = KVArena(list(span), 1, config.num_key_value_heads, config.head_dim, torch.float32,
                        torch.device("cpu"), 128)
        hidden = run_step(shard, arena, [StepRow(0, 0, len(ids))], hidden)
    logits = head_logits(shards[-1], hidden)
    reference = AutoModelForCausalLM.from_pretrained(compressed_model, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_another_quantization_is_refused_with_what_is_read(compressed_model, tmp_path):
    import json
    import shutil

    copy = tmp_path / "gptq"
    shutil.copytree(compressed_model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="pack-quantized 4-bit symmetric"):
        open_model_dir(copy)
