"""What each part of a model weighs once loaded, exact from the safetensors headers (no weight is
read): each decoder layer, the embedding and the head, in the dtype the stages run."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from layerbus.models.model_files import ModelFiles
from layerbus.models.tensor_reader import SAFETENSORS_DTYPES, TensorReader

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightSizes:
    """Bytes of each part of the model once loaded."""

    layers: tuple[int, ...]  # each decoder layer's weights
    embed: int  # model.embed_tokens
    head: int  # final norm + LM head (with the embedding's size when the head is tied to it)
    head_shares_embed: bool  # tied: a last stage without the embedding holds its own copy of the matrix


def weight_sizes(files: ModelFiles, dtype: str = "float32") -> WeightSizes:
    """Floating tensors count as `dtype` (stages convert them on load); others keep their stored size."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    element = DTYPE_BYTES[dtype]
    reader = TensorReader(files.tensor_files, files.path)
    layers = [0] * files.num_layers
    embed = head = 0
    for name in files.tensor_files:
        numel = math.prod(reader.shape(name))
        stored = SAFETENSORS_DTYPES.get(reader.dtype_name(name))
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
    tied = getattr(files.config, "tie_word_embeddings", False) or not files.has_tensor("lm_head.weight")
    if tied:
        head += embed
    return WeightSizes(layers=tuple(layers), embed=embed, head=head, head_shares_embed=tied)
