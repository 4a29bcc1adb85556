"""The attention shape of a decoder layer, read from a model config with transformers' own fallbacks.

Both sides need it: the broker prices KV memory and compute with it, stages size their KV arenas.
Works on any object with the config's attribute names (a `PretrainedConfig`, or a namespace in tests).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    """Heads of one decoder layer's attention."""

    heads: int  # query heads
    kv_heads: int  # key/value heads (fewer than `heads` under grouped-query attention)
    head_dim: int  # width of one head


def attention_shape(config) -> AttentionShape:
    """Configs that leave out `head_dim` mean hidden_size // heads; without `num_key_value_heads`,
    every query head has its own key/value head (plain multi-head attention)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return AttentionShape(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
