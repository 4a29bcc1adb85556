"""Decode attention without padding: each row attends over exactly its own cached keys.

Registered with transformers' AttentionInterface as "layerbus", so the library's own attention
modules (projections, RoPE, norms, biases) still run unchanged and only the kernel call differs.
A decode micro-batch mixes sequences of very different lengths; padding them to the longest and
masking made attention read up to twice the cache it needs and copy it when slots were not
adjacent. Here each row reads its slot's keys in place, which is also exactly what `generate`
computes for one sequence (SDPA with grouped-query attention and no mask). Prefill chunks and
anything else go to transformers' SDPA path unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from layerbus.stages.packing import PackedLayout

ATTENTION_NAME = "layerbus"


def layerbus_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """`layerbus_rows` (slot, cached length incl. the new token) per row marks a decode group: then
    `key`/`value` are the layer's whole arenas [slots, kv_heads, capacity, head_dim] and
    `query` is [rows, heads, 1, head_dim]."""
    layout = kwargs.pop("layerbus_layout", None)
    if layout is not None:
        return packed_attention(query, key, value, layout, kwargs.get("layerbus_window"), scaling)
    rows = kwargs.pop("layerbus_rows", None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    window = kwargs.get("sliding_window")
    outputs = []
    for row, (slot, length) in enumerate(rows):
        first = max(0, length - window) if window else 0
        outputs.append(F.scaled_dot_product_attention(
            query[row:row + 1], key[slot:slot + 1, :, first:length], value[slot:slot + 1, :, first:length],
            scale=scaling, enable_gqa=key.shape[1] != query.shape[1]))
    # [rows, heads, 1, head_dim] -> [rows, 1, heads, head_dim], the layout attention modules expect
    return torch.cat(outputs).transpose(1, 2).contiguous(), None


def packed_attention(query, keys, values, layout: PackedLayout, window: int | None, scaling):
    """Attention of a packed step (stages.packing): `query` is [1, heads, N, head_dim] in packed
    order, `keys`/`values` the layer's whole arenas [slots, kv_heads, capacity, head_dim], already
    holding this step's keys. Returns [1, N, heads, head_dim]."""
    heads, positions, head_dim = query.shape[1], query.shape[2], query.shape[3]
    gqa = keys.shape[1] != heads
    out = query.new_empty((1, positions, heads, head_dim))
    for run, mask in zip(layout.runs, layout.run_masks[window]):
        rows = slice(run.offset, run.offset + run.count)
        slots = slice(run.first_slot, run.first_slot + run.count)
        q = query[0, :, rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, head_dim]
        attended = F.scaled_dot_product_attention(q, keys[slots, :, :run.key_length],
                                                  values[slots, :, :run.key_length], attn_mask=mask,
                                                  scale=scaling, enable_gqa=gqa)
        out[0, rows] = attended[:, :, 0]
    for chunk, mask in zip(layout.chunks, layout.chunk_masks[window]):
        rows = slice(chunk.offset, chunk.offset + chunk.length)
        end = chunk.start + chunk.length
        attended = F.scaled_dot_product_attention(
            query[:, :, rows], keys[chunk.slot:chunk.slot + 1, :, :end], values[chunk.slot:chunk.slot + 1, :, :end],
            attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa)
        out[0, rows] = attended[0].transpose(0, 1)
    return out, None


def prefer_low_overhead_attention(device: torch.device) -> None:
    """On CUDA, leave cuDNN's kernel out of SDPA's choices, for the whole stage process.

    Measured on an H200 (torch 2.11, bfloat16, SmolLM2-135M, a step of 256 decode rows): SDPA chose
    cuDNN, and each call cost 1.96 ms of CPU against 12 us on the GPU, 115 ms of a 206 ms profile.
    A stage calls SDPA once per layer per decode run and once per layer per prefill chunk, with a key
    length that changes every step, so its steps were bound by that CPU time with the GPU idle.
    Flash and memory-efficient attention launch in microseconds; the math kernel stays as the fallback."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


AttentionInterface.register(ATTENTION_NAME, layerbus_attention)
