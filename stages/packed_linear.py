"""A Linear layer that holds its weight as GGUF-style blocks (models.weight_blocks) and the swap that puts
it in place of a decoder layer's attention and MLP projections.

Each projection's weight is either quantized from the checkpoint's full-precision tensor as it is read
(`int8`, `int4`: one tensor at a time, so a load never holds more than one full-precision weight beside
the blocks) or read as the checkpoint's own blocks (`native`). The embedding, norms and LM head keep the
shard's dtype.

The forward pass dequantizes the weight into the compute dtype and runs the ordinary matmul: for float32
that is exactly the weight a float32 import of the same blocks holds, so outputs match it token for token.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from layerbus.models.weight_blocks import BLOCK, Blocks, LAYOUTS, dequantize
from layerbus.stages.block_kernel import dequantize_rows


# Weights dequantized at once: 4 MiB of float32. Every projection of SmolLM2-135M is one tile (no copy
# of the output, one kernel call); a head of 49152 rows goes in tiles of 1820. Measured against 1 MiB
# tiles in bench/bench_weights.py: the per-tile overhead mattered more than the cache.
TILE_ELEMENTS = 1 << 20


class _TileBuffer(threading.local):
    """One float32 buffer per thread that every tile dequantizes into, reused by every projection of every
    layer. A fresh 4 MiB tensor per tile made the heap keep what the steps freed: a 1.28B int8 stage's
    resident memory rose 40-60 MiB over its first prefill steps and stayed there (glibc's thresholds stay
    high after a load: stages.host.large_allocations_mapped), which took a stage 3 MiB over a 1150 MiB
    --memory-budget the planner had filled; with the buffer the same steps add about 15 MiB. A tile is
    consumed by the matmul that follows it, before the next is written (one thread, one buffer)."""

    buffer: torch.Tensor | None = None

    def take(self, elements: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < elements:
            self.buffer = torch.empty(max(elements, TILE_ELEMENTS))
        return self.buffer


_tiles = _TileBuffer()


class PackedLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] held in 32-weight blocks."""

    def __init__(self, in_features: int, out_features: int, layout: str, bias: nn.Parameter | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.layout = LAYOUTS[layout]
        self.bias = bias
        # Not in the checkpoint under these names, so not in state_dict: load_blocks fills them.
        for name in ("d", "m", "qs"):
            self.register_buffer(name, None, persistent=False)

    def load_blocks(self, blocks: Blocks) -> None:
        if blocks.layout != self.layout or blocks.shape != (self.out_features, self.in_features):
            raise ValueError(f"blocks {blocks.layout.name} {list(blocks.shape)} do not fit a {self.layout.name} "
                             f"Linear of [{self.out_features}, {self.in_features}]")
        self.d, self.m, self.qs = blocks.d, blocks.m, blocks.qs

    def blocks(self) -> Blocks:
        return Blocks(self.layout, self.d, self.m, self.qs)

    def weight_bytes(self) -> int:
        return self.blocks().nbytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rows of the weight are dequantized a tile at a time, each tile multiplied while it is in cache: the
        # whole dequantized weight is never held (a tied head of 49152 x 576 would be 113 MB per step).
        # Each output column is one row's dot product, so tiling the rows leaves every sum as it was.
        step = max(16, TILE_ELEMENTS // self.in_features)
        if step >= self.out_features:  # one tile: no output buffer to fill
            return F.linear(x, self._weight_rows(slice(0, self.out_features), x.dtype), self.bias)
        flat = x.reshape(-1, self.in_features)
        out = flat.new_empty(flat.shape[0], self.out_features)
        for start in range(0, self.out_features, step):
            rows = slice(start, min(start + step, self.out_features))
            bias = self.bias[rows] if self.bias is not None else None
            out[:, rows] = F.linear(flat, self._weight_rows(rows, x.dtype), bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _weight_rows(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the weight, dequantized to exactly gguf's float32 values, in `dtype`. On a CPU in float32
        it is a view of this thread's tile buffer: valid until the next tile is dequantized."""
        blocks = self.blocks()
        count = len(range(*rows.indices(self.out_features)))
        into = _tiles.take(count * self.in_features) if blocks.d.device.type == "cpu" else None
        weight = dequantize_rows(blocks, rows, into)
        if weight is None:
            weight = dequantize(blocks, rows)
        return weight if dtype == torch.float32 else weight.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout={self.layout.name}"


class PackedEmbedding(nn.Module):
    """An embedding table held in blocks: each looked-up row is dequantized on its own (a row of blocks
    dequantizes to the very row of the whole table's dequantization)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.table: PackedLinear | None = None

    def load_blocks(self, blocks: Blocks) -> None:
        self.table = PackedLinear(self.embedding_dim, self.num_embeddings, blocks.layout.name, None)
        self.table.load_blocks(blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = Blocks(self.table.layout, self.table.d[flat], None if self.table.m is None else self.table.m[flat],
                      self.table.qs[flat])
        return dequantize(rows).to(self.dtype).reshape(*ids.shape, self.embedding_dim)


def pack_linears(layer: nn.Module, layout_of: Callable[[str], str | None], name_of: Callable[[str], str]) -> list[str]:
    """Replace each nn.Linear inside `layer` (on the meta device) for which `layout_of(name)` gives a block
    layout by an empty PackedLinear; return their names. `name_of(name)` is its checkpoint name, for errors."""
    packed = []
    for name, module in list(layer.named_modules()):
        if type(module) is not nn.Linear or (layout := layout_of(name)) is None:
            continue
        if module.in_features % BLOCK:
            raise ValueError(f"{name_of(name)} has {module.in_features} input channels, not a multiple of {BLOCK}: "
                             f"its weight cannot be held in blocks; use --weights fp32, bf16 or fp16")
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, child, PackedLinear(module.in_features, module.out_features, layout, module.bias))
        packed.append(name)
    return packed
