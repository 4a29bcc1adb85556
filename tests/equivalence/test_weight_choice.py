"""The planner's sizes of the default model's native weights (its GGUF blocks) are what a loaded shard holds.
tests/unit/test_weight_choice.py holds the choice of format and the tiny model's sizes."""

from __future__ import annotations

from layerbus.planner.model_memory import model_memory
from layerbus.models.model_files import open_model_dir
from layerbus.wire.spans import LayerRange


def test_planned_native_bytes_are_what_the_default_model_s_shard_holds(default_model):
    """The default model's GGUF blocks (Q4_1 layers, a Q8_0 embedding that is also the tied head), sized
    from its header, equal what a native shard of the whole model holds; a layer is 2.2 MB against 14.2."""
    from layerbus.stages.shard import ShardSpec, load_shard

    files = open_model_dir(default_model)
    memory = model_memory(files)
    native = memory.weights_in("native")
    assert memory.layer_weight_bytes[0] == 14_160_384 and native.layer_weight_bytes[0] == 2_216_448
    assert memory.weights_in("int8").layer_weight_bytes[0] == 3_764_736
    shard = load_shard(files, ShardSpec(LayerRange(0, files.num_layers), True, True, native=True))
    assert shard.parameter_bytes() == sum(native.layer_weight_bytes) + native.head_bytes
