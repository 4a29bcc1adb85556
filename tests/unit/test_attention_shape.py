"""The one reading of a config's attention shape, with transformers' fallbacks, used by broker and stages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from layerbus.models.attention_shape import AttentionShape, attention_shape


@pytest.mark.parametrize("fields, expected", [
    (dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64), AttentionShape(9, 3, 64)),
    (dict(hidden_size=64, num_attention_heads=4), AttentionShape(4, 4, 16)),  # neither: plain multi-head
    (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=None, head_dim=None), AttentionShape(4, 4, 16)),
    (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32), AttentionShape(4, 2, 32)),
])
def test_attention_shape(fields, expected):
    assert attention_shape(SimpleNamespace(**fields)) == expected
