"""GGUF's 32-weight blocks (Q8_0, Q4_0, Q4_1) as torch tensors: quantize, dequantize, split raw bytes.

A weight [out, in] becomes, per row, in/32 blocks. Each block has a scale `d` (float16), for Q4_1 a
minimum `m` (float16), and its 32 quants `qs`: Q8_0 as 32 int8, Q4_0 and Q4_1 as 16 bytes whose low
nibbles are elements 0-15 and high nibbles elements 16-31 (ggml's order). Dequantization follows the
gguf package's reference exactly, in float32 and in its order of operations (Q4_1: d * q + m; Q4_0:
d * (q - 8); Q8_0: q * d), so a model run on its blocks computes with the very weights that importing
the GGUF into float32 produced. Quantization follows gguf's `quantize_blocks` (rounding included), so
`int8`/`int4` on load give the blocks llama.cpp's converter would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class BlockLayout:
    """One of ggml's 32-weight block types."""

    name: str  # "q8_0", "q4_0" or "q4_1"
    ggml_type: int  # gguf.GGMLQuantizationType value
    block_bytes: int  # bytes per block in a GGUF file: d (2) [+ m (2)] + quants
    has_min: bool  # Q4_1 stores a per-block minimum
    bits: int  # 8 or 4


LAYOUTS = {
    "q4_0": BlockLayout("q4_0", 2, 18, False, 4),
    "q4_1": BlockLayout("q4_1", 3, 20, True, 4),
    "q8_0": BlockLayout("q8_0", 8, 34, False, 8),
}
LAYOUT_BY_GGML_TYPE = {layout.ggml_type: layout for layout in LAYOUTS.values()}


@dataclass
class Blocks:
    """A weight [rows, cols] in blocks: d [rows, cols/32] (+ m), qs [rows, cols/32, 16 or 32]."""

    layout: BlockLayout
    d: torch.Tensor  # float16 scales
    m: torch.Tensor | None  # float16 minimums (q4_1 only)
    qs: torch.Tensor  # uint8 packed nibbles (q4_*) or int8 quants (q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.d, self.m, self.qs) if t is not None)


def quantize(weight: torch.Tensor, layout_name: str) -> Blocks:
    """Blocks of `weight` [rows, cols] (cols a multiple of 32), computed as gguf's quantize_blocks does."""
    layout = LAYOUTS[layout_name]
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"a weight of {cols} input channels cannot be cut in blocks of {BLOCK}")
    x = weight.detach().to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)
    if layout.name == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        scaled = x * inverse
        qs = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int8)  # np_roundf: half away from 0
        return Blocks(layout, d.squeeze(-1).to(torch.float16), None, qs)
    if layout.name == "q4_1":
        low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (high - low) / 15
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc((x - low) * inverse + 0.5).clamp(0, 15).to(torch.uint8)
        return Blocks(layout, d.squeeze(-1).to(torch.float16), low.squeeze(-1).to(torch.float16), _pack_nibbles(q))
    # q4_0: the signed extreme maps to -8
    index = x.abs().argmax(-1, keepdim=True)
    d = torch.gather(x, -1, index) / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(x * inverse + 8.5).clamp(0, 15).to(torch.uint8)
    return Blocks(layout, d.squeeze(-1).to(torch.float16), None, _pack_nibbles(q))


# Rows quantized at once by quantize_rows: its float32 temporaries (the chunk, its scaled and rounded
# copies) stay near 4 MiB each, whatever the weight. Quantizing a 5952 x 2048 projection whole held six
# float32 copies of it at once (290 MB) beside the blocks; a 1.28B model's stage went 340 MB past its budget.
QUANTIZE_CHUNK_ELEMENTS = 1 << 17


def quantize_rows(weight: torch.Tensor, layout_name: str, chunk_elements: int = QUANTIZE_CHUNK_ELEMENTS) -> Blocks:
    """quantize(weight) a chunk of rows at a time, each chunk converted to float32 on its own, so the
    weight may stay in its stored dtype (bfloat16 converts to float32 exactly) and the temporaries are
    a chunk's. Blocks are per row, so the result is quantize's, bit for bit."""
    rows, cols = weight.shape
    step = max(1, chunk_elements // max(1, cols))
    if step >= rows:
        return quantize(weight, layout_name)
    layout = LAYOUTS[layout_name]
    if cols % BLOCK:
        raise ValueError(f"a weight of {cols} input channels cannot be cut in blocks of {BLOCK}")
    per_row = cols // BLOCK
    d = torch.empty(rows, per_row, dtype=torch.float16)
    m = torch.empty(rows, per_row, dtype=torch.float16) if layout.has_min else None
    qs = torch.empty(rows, per_row, BLOCK if layout.bits == 8 else BLOCK // 2,
                     dtype=torch.int8 if layout.bits == 8 else torch.uint8)
    for start in range(0, rows, step):
        part = quantize(weight[start:start + step], layout_name)
        d[start:start + step] = part.d
        qs[start:start + step] = part.qs
        if m is not None:
            m[start:start + step] = part.m
    return Blocks(layout, d, m, qs)


def dequantize(blocks: Blocks, rows: slice = slice(None)) -> torch.Tensor:
    """The float32 weight [rows, cols] (or a slice of its rows), exactly as gguf's dequantize computes it."""
    d = blocks.d[rows].to(torch.float32).unsqueeze(-1)
    if blocks.layout.bits == 8:
        q = blocks.qs[rows].to(torch.float32)
        weight = q * d
    else:
        q = _unpack_nibbles(blocks.qs[rows])
        if blocks.layout.has_min:
            weight = d * q.to(torch.float32) + blocks.m[rows].to(torch.float32).unsqueeze(-1)
        else:
            weight = d * (q.to(torch.int8) - 8).to(torch.float32)
    return weight.reshape(weight.shape[0], -1)


def from_raw(raw: torch.Tensor, layout: BlockLayout, rows: int, cols: int) -> Blocks:
    """Split a GGUF tensor's raw bytes (uint8, rows x cols/32 x block_bytes) into d, m and qs."""
    per_row = cols // BLOCK
    raw = raw.reshape(rows, per_row, layout.block_bytes)
    d = raw[..., 0:2].contiguous().view(torch.float16).reshape(rows, per_row)
    start = 2
    m = None
    if layout.has_min:
        m = raw[..., 2:4].contiguous().view(torch.float16).reshape(rows, per_row)
        start = 4
    qs = raw[..., start:].contiguous()
    if layout.bits == 8:
        qs = qs.view(torch.int8)
    return Blocks(layout, d, m, qs)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0-15 -> [..., 16] bytes: element j in the low nibble, j + 16 in the high one."""
    return q[..., :16] | (q[..., 16:] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)
