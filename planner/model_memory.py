"""The model's memory needs as placement prices them: the weights of each part (read from the
safetensors headers by models/weight_sizes.py) in every --weights format a stage may hold, what one
slot-token of KV costs and the activations."""

from __future__ import annotations

from layerbus.planner.placement import ModelMemory
from layerbus.planner.plan_values import FormatWeights
from layerbus.models.attention_shape import attention_shape
from layerbus.models.model_files import ModelFiles
from layerbus.models.weight_sizes import DTYPE_BYTES, weight_sizes
from layerbus.wire.weight_formats import FULL_PRECISION, QUANTIZE_ON_LOAD

FULL_FORMAT = {dtype: name for name, dtype in FULL_PRECISION.items()}  # "float32" -> "fp32"


def model_memory(files: ModelFiles, dtype: str = "float32") -> ModelMemory:
    """Bytes per part of the model once loaded as `dtype` (floating tensors convert to it, others keep
    theirs); `formats` holds the weights in each other format (planner.weight_choice picks among them)."""
    weights = weight_sizes(files, dtype)
    element = DTYPE_BYTES[dtype]
    config = files.config
    shape = attention_shape(config)
    return ModelMemory(
        layer_weight_bytes=weights.layers, embed_bytes=weights.embed, head_bytes=weights.head,
        head_shares_embed=weights.head_shares_embed,
        kv_bytes_per_token=2 * shape.kv_heads * shape.head_dim * element,
        activation_bytes_per_token=config.hidden_size * element, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_attention_heads=shape.heads, vocab_size=config.vocab_size,
        dtype_bytes=element, formats=format_weights(files, dtype), full_format=FULL_FORMAT[dtype])


def format_weights(files: ModelFiles, dtype: str) -> tuple[FormatWeights, ...]:
    """The weights in every --weights format but auto: full precision in each dtype, int8 and int4
    (quantized on load, the rest in `dtype`) and native (the directory's GGUF blocks, the rest in `dtype`)."""
    sizes = {name: weight_sizes(files, full) for name, full in FULL_PRECISION.items()}
    sizes |= {name: weight_sizes(files, dtype, quantize_to=layout) for name, layout in QUANTIZE_ON_LOAD.items()}
    sizes["native"] = weight_sizes(files, dtype, native=True)
    return tuple(FormatWeights(name, s.layers, s.embed, s.head) for name, s in sizes.items())
