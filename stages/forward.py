"""One pipeline step on one stage: split the micro-batch into groups, run them through the shard.

A micro-batch mixes decoding rows (one new token each) and prefill chunks (many tokens of one
sequence). Decoding rows run together as one batch. Prefill chunks of similar lengths run together,
padded on the right to the longest, as long as padding adds at most a quarter to the work: run one
by one, dozens of short chunks (an eval's questions and choices) would each pay for a pass over
every layer's weights, while one long prompt still never multiplies the work of the short ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerbus.stages.kv_cache import CacheGroup, KVArena
from layerbus.stages.packing import PackedLayout
from layerbus.stages.shard import StageShard
from layerbus.wire.protocol import StepRow


@dataclass
class GroupRun:
    group: CacheGroup
    row_indices: list[int]  # which StepRows (by index) the group's rows are


# Prefill chunks share a padded group while padding adds at most this fraction of their own positions.
MAX_PADDING = 0.25
# ... and while the group stays this small: activations grow with rows x positions.
MAX_GROUP_POSITIONS = 1024


def plan_groups(rows: list[StepRow], max_context: int | None = None) -> list[GroupRun]:
    """Decode rows form one group in slot order (adjacent slots share a cache slice); prefill chunks
    are grouped longest first, each group padded to its first (longest) chunk while padding stays
    under MAX_PADDING and every padded row still ends within `max_context`."""
    decode = sorted((i for i, row in enumerate(rows) if row.length == 1), key=lambda i: rows[i].slot)
    groups = []
    if decode:
        groups.append(GroupRun(CacheGroup([rows[i].slot for i in decode], [rows[i].start for i in decode], 1), decode))
    prefill = sorted((i for i, row in enumerate(rows) if row.length > 1), key=lambda i: (-rows[i].length, i))
    batches: list[list[int]] = []
    for i in prefill:
        current = batches[-1] if batches else None
        if current is not None:
            width = rows[current[0]].length
            real = sum(rows[j].length for j in current) + rows[i].length
            padded = width * (len(current) + 1)
            if (padded <= (1 + MAX_PADDING) * real and padded <= MAX_GROUP_POSITIONS
                    and (max_context is None or rows[i].start + width <= max_context)):
                current.append(i)
                continue
        batches.append([i])
    for batch in batches:
        lengths = [rows[i].length for i in batch]
        group = CacheGroup([rows[i].slot for i in batch], [rows[i].start for i in batch], lengths[0],
                           lengths if len(set(lengths)) > 1 else None)
        groups.append(GroupRun(group, batch))
    return groups


@dataclass(frozen=True)
class ShardPart:
    """Some consecutive layers of a shard, run alone (a replay after a re-plan, broker.replay_window):
    the embedding only when the part starts at the model's first layer, never the final norm (a
    replay emits nothing)."""

    config: object
    embed_tokens: object
    layers: list
    layer_windows: list
    rotary_emb: object
    device: torch.device
    dtype: torch.dtype
    attends_in_place: bool
    norm: None = None


def shard_part(shard: StageShard, start: int, end: int) -> ShardPart:
    """Layers [start, end) of the model, which `shard` must hold."""
    held = shard.spec.layers
    if not held.start <= start < end <= held.end:
        raise ValueError(f"layers [{start}, {end}) are not all held here ({held})")
    first, last = start - held.start, end - held.start
    return ShardPart(shard.config, shard.embed_tokens if start == 0 else None, list(shard.layers)[first:last],
                     shard.layer_windows[first:last], shard.rotary_emb, shard.device, shard.dtype,
                     shard.attends_in_place)


@torch.inference_mode()
def run_step(shard: StageShard | ShardPart, arena: KVArena, rows: list[StepRow], inputs: torch.Tensor) -> torch.Tensor:
    """Run a step; `inputs` is packed in row order: token ids [N] on the first stage, hidden states
    [N, hidden] elsewhere. Returns hidden states [N, hidden] in row order (after the final norm on
    the last stage)."""
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + row.length)
    if inputs.shape[0] != offsets[-1]:
        raise ValueError(f"step carries {inputs.shape[0]} positions but its rows add up to {offsets[-1]}")
    if shard.attends_in_place and rows:
        return _run_packed(shard, arena, rows, inputs)
    outputs: list[torch.Tensor | None] = [None] * len(rows)
    for run in plan_groups(rows, arena.max_context):
        # [B, T] token ids or [B, T, hidden]: rows of a decode group have T = 1; shorter prefill chunks
        # are padded with zeros (token 0 or a zero vector) up to the group's length.
        width = run.group.length
        parts = [_padded(inputs[offsets[i]:offsets[i + 1]], width) for i in run.row_indices]
        batch = torch.stack(parts).to(shard.device)
        hidden = _run_group(shard, arena, run.group, batch)
        for j, i in enumerate(run.row_indices):
            outputs[i] = hidden[j, :rows[i].length]
    if not outputs:  # a step that only releases slots
        return torch.empty((0, shard.config.hidden_size), dtype=shard.dtype, device=shard.device)
    return torch.cat(outputs)


def _run_packed(shard: StageShard, arena: KVArena, rows: list[StepRow], inputs: torch.Tensor) -> torch.Tensor:
    """Every row in one pass over the layers (see stages.packing); returns rows in their own order."""
    layout = PackedLayout(rows, set(shard.layer_windows), shard.device)
    arena.prepare_rows(layout.slots, layout.starts, layout.ends)
    packed = inputs if layout.gather is None else inputs.index_select(0, layout.gather.to(inputs.device))
    packed = packed.to(shard.device).unsqueeze(0)  # [1, N] token ids or [1, N, hidden]
    hidden = _embedded(shard, packed)
    position_embeddings = shard.rotary_emb(hidden, layout.positions)
    cache = arena.packed_view(layout)
    for layer, window in zip(shard.layers, shard.layer_windows):
        # The window comes from the shard (its reading of the config), as the grouped path's masks do.
        out = layer(hidden, attention_mask=None, position_ids=layout.positions, cache=cache, use_cache=True,
                    position_embeddings=position_embeddings, layerbus_layout=layout, layerbus_window=window)
        hidden = out[0] if isinstance(out, tuple) else out
    arena.commit_rows(layout.slots, layout.ends)
    if shard.norm is not None:
        hidden = shard.norm(hidden)
    hidden = hidden[0]
    return hidden if layout.restore is None else hidden.index_select(0, layout.restore)


def _embedded(shard: StageShard, batch: torch.Tensor) -> torch.Tensor:
    if shard.embed_tokens is None:
        return batch.to(shard.dtype)
    hidden = shard.embed_tokens(batch)
    multiplier = getattr(shard.config, "embedding_multiplier", None)  # Granite scales embeddings
    return hidden * multiplier if multiplier else hidden


def _padded(part: torch.Tensor, width: int) -> torch.Tensor:
    if part.shape[0] == width:
        return part
    padding = part.new_zeros((width - part.shape[0], *part.shape[1:]))
    return torch.cat([part, padding])


def _run_group(shard: StageShard, arena: KVArena, group: CacheGroup, batch: torch.Tensor) -> torch.Tensor:
    arena.prepare(group)
    hidden = _embedded(shard, batch)
    positions = _positions(group, shard.device)  # [B, T]
    position_embeddings = shard.rotary_emb(hidden, positions)
    in_place = group.length == 1 and shard.attends_in_place
    extra = {"layerbus_rows": list(zip(group.slots, group.ends))} if in_place else {}
    masks = {window: None if in_place else _attention_mask(group, window, shard.dtype, shard.device)
             for window in set(shard.layer_windows)}
    cache = arena.view(group, in_place)
    for layer, window in zip(shard.layers, shard.layer_windows):
        out = layer(hidden, attention_mask=masks[window], position_ids=positions, cache=cache,
                    use_cache=True, position_embeddings=position_embeddings, **extra)
        hidden = out[0] if isinstance(out, tuple) else out
    arena.commit(group)
    if shard.norm is not None:
        hidden = shard.norm(hidden)
    return hidden


def _positions(group: CacheGroup, device) -> torch.Tensor:
    starts = torch.tensor(group.starts, device=device).unsqueeze(1)
    return starts + torch.arange(group.length, device=device).unsqueeze(0)


def _attention_mask(group: CacheGroup, window: int | None, dtype, device) -> torch.Tensor:
    """Additive mask [B, 1, T, L]: 0 where a query may attend, the dtype's minimum elsewhere.

    Query t of row b sits at position start_b + t and sees keys at positions <= that (and, with a
    sliding window, > that - window). Keys past a row's own length are padding."""
    key_length = max(group.ends)
    query_pos = _positions(group, device).unsqueeze(-1)  # [B, T, 1]
    key_pos = torch.arange(key_length, device=device).view(1, 1, -1)  # [1, 1, L]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


@torch.inference_mode()
def head_logits(shard: StageShard, hidden: torch.Tensor) -> torch.Tensor:
    """Logits in float32 for normed hidden states [N, hidden] (last stage only)."""
    logits = shard.lm_head(hidden).float()
    config = shard.config
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma2
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
