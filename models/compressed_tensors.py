"""A compressed-tensors checkpoint (`pack-quantized`, 4-bit symmetric groups, as llm-compressor's W4A16
scheme writes) read as GGUF Q4_0 blocks, so a stage holds it packed and computes with the very weights
the library's own decompression gives.

Each projection is `weight_packed` (int32, eight 4-bit quants per word, element j at bits 4j, each
stored as q + 8), `weight_scale` (one per group) and `weight_shape`; its weight is q x scale. Q4_0 is
d x (q' - 8) with q' the stored nibble: the same quant, and a group of 32k weights is k blocks sharing
its scale. Exact where the scales fit float16 (Q4_0 keeps d in float16); a checkpoint whose scales do
not is refused with the reason, rather than run on weights that differ from the library's.
"""

from __future__ import annotations

import torch

from layerbus.models.model_files import CompressedScheme, ModelDirError
from layerbus.models.weight_blocks import BLOCK, LAYOUTS, Blocks


class CompressedBlocks:
    """A compressed-tensors checkpoint's packed projections, by their `...weight` names, as Q4_0 blocks."""

    def __init__(self, reader, scheme: CompressedScheme):
        self.reader, self.scheme = reader, scheme

    def layout(self, name: str) -> str | None:
        return "q4_0" if name.endswith(".weight") and self.reader.has(name + "_packed") else None

    def read(self, name: str) -> Blocks:
        rows, cols = (int(v) for v in self._tensor(name + "_shape", torch.int64))
        packed = self._tensor(name + "_packed", torch.int32)  # [rows, cols / 8]
        scale = self._tensor(name + "_scale", torch.float32)  # [rows, cols / group]
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        nibbles = ((packed[..., None] >> shifts) & 0xF).to(torch.uint8).reshape(rows, cols)
        d = scale.to(torch.float16)
        if not torch.equal(d.to(torch.float32), scale):
            raise ModelDirError(f"{name}: its compressed-tensors scales do not fit float16, which Q4_0 blocks keep; "
                                "layerbus would run on other weights than the checkpoint's")
        d = d.repeat_interleave(self.scheme.group_size // BLOCK, dim=1)  # every 32-weight block of a group
        blocks = nibbles.reshape(rows, cols // BLOCK, BLOCK)
        qs = blocks[..., :16] | (blocks[..., 16:] << 4)  # ggml's order: elements 0-15 low, 16-31 high
        return Blocks(LAYOUTS["q4_0"], d.contiguous(), None, qs.contiguous())

    def _tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        target = torch.empty(self.reader.shape(name), dtype=dtype)
        self.reader.read_into(name, target)
        return target
