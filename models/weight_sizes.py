"""What each part of a model weighs once loaded, exact from the safetensors headers (no weight is
read): each decoder layer, the embedding and the head, in the dtype the stages run, and in the block
layouts a stage may hold instead (`--weights int8`/`int4` quantized on load, `native` a GGUF's own)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from layerbus.models.model_files import ModelFiles
from layerbus.models.tensor_reader import SAFETENSORS_DTYPES, TensorReader

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Bytes of one 32-weight block (models.weight_blocks.LAYOUTS, kept here so sizing needs no block code;
# tests/unit/test_weight_choice.py holds the two equal).
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
BLOCK = 32
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightSizes:
    """Bytes of each part of the model once loaded."""

    layers: tuple[int, ...]  # each decoder layer's weights
    embed: int  # model.embed_tokens
    head: int  # final norm + LM head (with the embedding's size when the head is tied to it)
    head_shares_embed: bool  # tied: a last stage without the embedding holds its own copy of the matrix


def weight_sizes(files: ModelFiles, dtype: str = "float32", quantize_to: str | None = None,
                 native: bool = False) -> WeightSizes:
    """Floating tensors count as `dtype` (stages convert them on load); others keep their stored size.

    `quantize_to` ("q8_0", "q4_1"): the decoder layers' projections count as those blocks, as
    stages.weight_sources.QuantizeOnLoad packs them (a projection whose input width is not whole
    blocks cannot be packed; the stage says so when it loads). `native`: every tensor the model
    directory's GGUF holds in a block layout counts as its blocks, as stages.weight_sources.NativeBlocks
    reads them (the embedding and a tied head too); without a GGUF the safetensors are the format."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if quantize_to is not None and quantize_to not in BLOCK_BYTES:
        raise ValueError(f"block layout {quantize_to!r} is not one of {sorted(BLOCK_BYTES)}")
    element = DTYPE_BYTES[dtype]
    reader = TensorReader(files.tensor_files, files.path)
    blocks = _native_block_bytes(files) if native else {}
    layers = [0] * files.num_layers
    embed = head = 0
    for name in files.tensor_files:
        shape = reader.shape(name)
        numel = math.prod(shape)
        stored = SAFETENSORS_DTYPES.get(reader.dtype_name(name))
        size = numel * (element if stored is None or stored.is_floating_point else stored.itemsize)
        match = _LAYER.match(name)
        if name in blocks:
            size = blocks[name]
        elif quantize_to is not None and match and _is_projection(name, shape):
            size = numel // BLOCK * BLOCK_BYTES[quantize_to]
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


def _is_projection(name: str, shape) -> bool:
    """A decoder layer's linear weight (2-D) whose rows are whole blocks: what quantizing on load packs."""
    return name.endswith(".weight") and len(shape) == 2 and shape[1] % BLOCK == 0


def _native_block_bytes(files: ModelFiles) -> dict[str, int]:
    """Hugging Face tensor name -> bytes of its blocks in the directory's GGUF ({} without one)."""
    from layerbus.models.gguf_blocks import GGUFBlocks, model_gguf

    gguf = model_gguf(files.path)
    if gguf is None:
        return {}
    source = GGUFBlocks(gguf, files.config)
    return {name: source.block_bytes(name) for name in files.tensor_files if source.layout(name) is not None}
