"""How one step's rows are packed into a single forward pass, and what attention needs to know.

Every row of a step (decode rows, prefill chunks, scoring rows) runs through the layers as one
sequence of positions [1, N]: the projections and the MLP, almost all of a layer's work, then
run as one matmul over all N positions instead of one per group, and no position is padding.
Only attention sees the rows apart. The layout is computed once per step, before the first
layer, and every layer reuses it: the packed order, each row's slot and positions, and the masks.

Packed order: single-position rows (decode rows) first, in slot order, then the longer chunks.
Decode rows whose slots are adjacent form *runs*: a run attends in one kernel call over a plain
slice of the KV arena (no copy), masked to each row's own length. A run grows only while masking
wastes little, so one long sequence does not make its short neighbours read its whole length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerbus.wire.protocol import StepRow

# A decode run is extended while the keys it reads (rows x longest) stay within this factor of
# the keys its rows need; past that, the next row starts a run of its own.
MAX_RUN_WASTE = 1.5
# Runs of rows whose contexts are all this short are never split: reading a few extra keys costs
# less than another kernel call.
SHORT_CONTEXT = 64


@dataclass(frozen=True)
class DecodeRun:
    """Adjacent slots, one new token each, attended in one call."""

    offset: int  # packed position of the run's first row
    first_slot: int
    lengths: tuple[int, ...]  # each row's cached length including its new token

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def key_length(self) -> int:
        return max(self.lengths)


@dataclass(frozen=True)
class Chunk:
    """Several new tokens of one slot (a prefill or scoring chunk)."""

    offset: int  # packed position of the chunk's first token
    slot: int
    start: int  # position of its first token
    length: int


class PackedLayout:
    """The packed form of a step's rows: order, positions, KV writes, and per-window masks."""

    def __init__(self, rows: list[StepRow], windows: set[int | None], device: torch.device):
        decode = sorted((i for i, row in enumerate(rows) if row.length == 1), key=lambda i: rows[i].slot)
        chunks = [i for i, row in enumerate(rows) if row.length > 1]
        self.order = decode + chunks  # packed position order, as indices into `rows`
        self.num_positions = sum(row.length for row in rows)
        self.num_decode = len(decode)
        self.runs = _decode_runs([rows[i] for i in decode])
        self.chunks: list[Chunk] = []
        offset = len(decode)
        for i in chunks:
            row = rows[i]
            self.chunks.append(Chunk(offset, row.slot, row.start, row.length))
            offset += row.length
        self.slots = [rows[i].slot for i in self.order]
        self.starts = [rows[i].start for i in self.order]
        self.ends = [rows[i].start + rows[i].length for i in self.order]
        positions = [p for i in self.order for p in range(rows[i].start, rows[i].start + rows[i].length)]
        self.positions = torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0)  # [1, N]
        self.decode_slots = torch.tensor(self.slots[:self.num_decode], dtype=torch.long, device=device)
        self.decode_positions = torch.tensor(self.starts[:self.num_decode], dtype=torch.long, device=device)
        # Where each row's positions sit in the packed sequence, to put the outputs back in row order.
        row_offsets, offset = {}, 0
        for i in self.order:
            row_offsets[i] = offset
            offset += rows[i].length
        restore = [p for i in range(len(rows)) for p in range(row_offsets[i], row_offsets[i] + rows[i].length)]
        self.restore = None if restore == list(range(len(restore))) else torch.tensor(restore, device=device)
        input_offsets = [0]
        for row in rows:
            input_offsets.append(input_offsets[-1] + row.length)
        gather = [p for i in self.order for p in range(input_offsets[i], input_offsets[i + 1])]
        self.gather = None if gather == list(range(len(gather))) else torch.tensor(gather, device=device)
        self.run_masks = {window: [_run_mask(run, window, device) for run in self.runs] for window in windows}
        self.chunk_masks = {window: [_chunk_mask(chunk, window, device) for chunk in self.chunks] for window in windows}


def _decode_runs(rows: list[StepRow]) -> list[DecodeRun]:
    runs: list[DecodeRun] = []
    offset = 0
    current: list[StepRow] = []
    longest = total = 0  # of the current run's lengths, kept as it grows: a step of 256 rows is one run
    for row in rows:
        length = row.start + 1
        if current and _extends(current[-1].slot, longest, total, len(current), row.slot, length):
            current.append(row)
            longest, total = max(longest, length), total + length
            continue
        if current:
            runs.append(DecodeRun(offset, current[0].slot, tuple(r.start + 1 for r in current)))
            offset += len(current)
        current, longest, total = [row], length, length
    if current:
        runs.append(DecodeRun(offset, current[0].slot, tuple(r.start + 1 for r in current)))
    return runs


def _extends(last_slot: int, longest: int, total: int, count: int, slot: int, length: int) -> bool:
    """Whether a row (`slot`, cached `length`) joins a run whose `count` rows end at `last_slot`, with these
    `longest` and `total` lengths: only the next slot, and only while masking wastes little."""
    if slot != last_slot + 1:
        return False
    longest = max(longest, length)
    return longest <= SHORT_CONTEXT or longest * (count + 1) <= MAX_RUN_WASTE * (total + length)


def _run_mask(run: DecodeRun, window: int | None, device) -> torch.Tensor | None:
    """[rows, 1, 1, keys] True where a row may attend; None when every row sees every key."""
    lengths = torch.tensor(run.lengths, device=device).view(-1, 1)
    keys = torch.arange(run.key_length, device=device).view(1, -1)
    allowed = keys < lengths
    if window is not None:
        allowed &= keys >= lengths - window
    if bool(allowed.all()):
        return None
    return allowed.view(run.count, 1, 1, run.key_length)


def _chunk_mask(chunk: Chunk, window: int | None, device) -> torch.Tensor | None:
    """[1, 1, T, start + T]: query t (position start + t) sees keys up to its own position (and, in
    a sliding window, after position - window). None for a causal chunk from position 0 without a
    window: the kernel's own causal flag then computes exactly what `generate` does."""
    if chunk.start == 0 and window is None:
        return None
    query = torch.arange(chunk.start, chunk.start + chunk.length, device=device).view(-1, 1)
    keys = torch.arange(chunk.start + chunk.length, device=device).view(1, -1)
    allowed = keys <= query
    if window is not None:
        allowed &= keys > query - window
    return allowed.view(1, 1, chunk.length, -1)
