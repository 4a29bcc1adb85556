"""Conversations to render, and the check that the light renderer (models.chat_template) renders a model's
template exactly as transformers' `apply_chat_template(..., tokenize=False)` does."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from layerbus.models.chat_template import read_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "Summarize in one sentence:\n\nThe ferry leaves at noon."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello {{ not a variable }} {% raw %}"}],
    [{"role": "user", "content": "First?"}, {"role": "assistant", "content": "Yes."},
     {"role": "user", "content": "Ünïcödé, emoji \U0001F600, <b>&'quotes'</b> and <|im_start|> as text"}],
]


def assert_renders_like_transformers(model_dir: Path) -> None:
    ours = read_chat_template(model_dir)
    theirs = AutoTokenizer.from_pretrained(model_dir)
    assert ours is not None and ours.chat_template, f"{model_dir}: the light renderer should take this template"
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            got = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert got == want, (messages, add_generation_prompt)
