"""The model's memory needs, exact from the safetensors headers (no weight is read), in the dtype the
stages run: what each layer, the embedding and the head weigh, and what one slot-token of KV costs."""

from __future__ import annotations

import math
import re

from layerbus.broker.placement import ModelMemory
from layerbus.stages.model_files import ModelFiles
from layerbus.stages.tensor_reader import SAFETENSORS_DTYPES, TensorReader

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def model_memory(files: ModelFiles, dtype: str = "float32") -> ModelMemory:
    """Bytes per part of the model once loaded as `dtype` (floating tensors convert to it, others keep theirs)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    element = DTYPE_BYTES[dtype]
    reader = TensorReader(files.tensor_files, files.path)
    config = files.config
    layers = [0] * files.num_layers
    embed = head = 0
    for name in files.tensor_files:
        numel = math.prod(reader.shape(name))
        stored = SAFETENSORS_DTYPES.get(reader._entry(name)[1]["dtype"])
        size = numel * (element if stored is None or stored.is_floating_point else stored.itemsize)
        match = _LAYER.match(name)
        if match:
            index = int(match.group(1))
            if index < len(layers):
                layers[index] += size
        elif name.startswith("model.embed_tokens."):
            embed += size
        elif name.startswith("model.norm.") or name.startswith("lm_head."):
            head += size
    tied = getattr(config, "tie_word_embeddings", False) or not files.has_tensor("lm_head.weight")
    if tied:
        head += embed  # a last stage without the embedding holds its own copy of the matrix
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelMemory(
        layer_weight_bytes=tuple(layers), embed_bytes=embed, head_bytes=head, head_shares_embed=tied,
        kv_bytes_per_token=2 * kv_heads * head_dim * element,
        activation_bytes_per_token=config.hidden_size * element, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_attention_heads=heads, vocab_size=config.vocab_size,
        dtype_bytes=element)
