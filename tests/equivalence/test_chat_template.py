"""The default model's chat template rendered without transformers (models.chat_template) renders exactly what
transformers' `apply_chat_template(..., tokenize=False)` renders. tests/unit/test_chat_template.py holds the
tiny model's template and the templates the light renderer must step aside for."""

from __future__ import annotations

from tests.helpers.chat_templates import assert_renders_like_transformers


def test_default_model_template_renders_like_transformers(default_model) -> None:
    assert_renders_like_transformers(default_model)
