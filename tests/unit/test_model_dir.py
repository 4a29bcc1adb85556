"""Model directories a stage is pointed at: broken ones are refused with the problem named, and
tensors are read straight into their parameters (sharded checkpoints, other dtypes, damage)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from layerbus.models.model_files import ModelDirError, open_model_dir, safetensors_tensor_names
from layerbus.models.tensor_reader import TensorReader
from layerbus.stages.shard import ShardSpec, load_shard
from tests.helpers.tiny_models import make_sharded_copy
from layerbus.wire.spans import LayerRange


@pytest.fixture
def model_copy(tiny_models, tmp_path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_models("llama"), target)
    return target


def edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def test_missing_directory_names_the_way_out(tmp_path):
    with pytest.raises(ModelDirError, match=r"does not exist.*layerbus model default"):
        open_model_dir(tmp_path / "nowhere")


def test_other_architecture_is_refused_with_the_supported_list(model_copy):
    edit_config(model_copy, architectures=["BertForMaskedLM"])
    with pytest.raises(ModelDirError, match=r"BertForMaskedLM.*not supported.*LlamaForCausalLM"):
        open_model_dir(model_copy)


def test_unknown_dtype_is_refused(model_copy):
    edit_config(model_copy, dtype="float8_e4m3fn", torch_dtype="float8_e4m3fn")
    with pytest.raises(ModelDirError, match=r"float8_e4m3fn"):
        open_model_dir(model_copy)


def test_pickle_weights_only_are_refused_not_loaded(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "pytorch_model.bin")
    with pytest.raises(ModelDirError, match=r"no \*\.safetensors.*pytorch_model\.bin.*never unpickles"):
        open_model_dir(model_copy)


def test_missing_shard_and_bad_index_are_named(tiny_models, tmp_path):
    sharded = make_sharded_copy(tiny_models("llama"), tmp_path / "sharded", max_shard_bytes=200_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ModelDirError, match=rf"shard\(s\) {shards[-1].name}.*missing"):
        open_model_dir(sharded)
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelDirError, match=r"not a valid index.*weight_map"):
        open_model_dir(sharded)


def test_checkpoint_missing_a_layer_is_refused(model_copy):
    edit_config(model_copy, num_hidden_layers=6)  # the weights hold 4
    with pytest.raises(ModelDirError, match=r"no weights for layer\(s\) \[4, 5\]"):
        open_model_dir(model_copy)


def test_tensor_names_come_from_the_header_as_safetensors_reads_it(model_copy):
    from safetensors import safe_open

    file = model_copy / "model.safetensors"
    with safe_open(file, framework="pt") as handle:
        assert sorted(safetensors_tensor_names(file)) == sorted(handle.keys())


@pytest.mark.parametrize("damage", ["garbage", "empty", "length past the end", "header not an object"])
def test_a_damaged_safetensors_header_is_refused_with_the_file_named(model_copy, damage):
    file = model_copy / "model.safetensors"
    data = file.read_bytes()
    damaged = {"garbage": b"\xff" * 64, "empty": b"",
               "length past the end": (len(data) * 2).to_bytes(8, "little") + data[8:],
               "header not an object": (2).to_bytes(8, "little") + b"[]"}[damage]
    file.write_bytes(damaged)
    with pytest.raises(ModelDirError, match=rf"{file}.* is not a readable safetensors file.*re-download"):
        open_model_dir(model_copy)


def test_sharded_checkpoint_loads_the_same_parameters(tiny_models, tmp_path):
    original = tiny_models("qwen2")
    sharded = make_sharded_copy(original, tmp_path / "sharded", max_shard_bytes=150_000)
    spec = ShardSpec(LayerRange(1, 3), is_first=False, is_last=True)
    one, many = load_shard(open_model_dir(original), spec), load_shard(open_model_dir(sharded), spec)
    for (name, a), (_, b) in zip(one.state_dict().items(), many.state_dict().items()):
        assert torch.equal(a, b), name


def test_reader_converts_dtypes_and_refuses_damage(tmp_path):
    weights = {"a": torch.randn(4, 3, dtype=torch.bfloat16), "b": torch.arange(6, dtype=torch.int64)}
    path = tmp_path / "w.safetensors"
    save_file(weights, str(path))
    reader = TensorReader({"a": path, "b": path}, tmp_path)
    into = torch.empty(4, 3, dtype=torch.float32)
    reader.read_into("a", into)  # bfloat16 on disk, float32 in the stage
    assert torch.equal(into, weights["a"].float())
    exact = torch.empty(6, dtype=torch.int64)
    reader.read_into("b", exact)
    assert torch.equal(exact, weights["b"])
    with pytest.raises(ModelDirError, match=r"shape \(6,\) in the checkpoint but the config implies \(5,\)"):
        reader.read_into("b", torch.empty(5, dtype=torch.int64))
    with pytest.raises(ModelDirError, match=r"tensor c is missing"):
        TensorReader({}, tmp_path).read_into("c", exact)
    truncated = tmp_path / "t.safetensors"
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    truncated.write_bytes(path.read_bytes()[:8 + header_length + 4])  # both tensors cut short
    with pytest.raises(ModelDirError, match=r"truncated"):
        TensorReader({"b": truncated}, tmp_path).read_into("b", exact)
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelDirError, match=r"not a readable safetensors file"):
        TensorReader({"b": garbage}, tmp_path).read_into("b", exact)
