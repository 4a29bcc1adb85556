"""The model's memory needs as placement prices them: the weights of each part (read from the
safetensors headers by models/weight_sizes.py), what one slot-token of KV costs and the activations."""

from __future__ import annotations

from layerbus.broker.placement import ModelMemory
from layerbus.models.attention_shape import attention_shape
from layerbus.models.model_files import ModelFiles
from layerbus.models.weight_sizes import DTYPE_BYTES, weight_sizes


def model_memory(files: ModelFiles, dtype: str = "float32") -> ModelMemory:
    """Bytes per part of the model once loaded as `dtype` (floating tensors convert to it, others keep theirs)."""
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
        dtype_bytes=element)
