"""The frame shortcut for rendering a job's prompts gives exactly what rendering each item in full gives."""

from __future__ import annotations

import pytest

from layerbus.jobs.prompts import PromptRenderer
from layerbus.jobs.records import InputRecord
from layerbus.jobs.tasks import TaskSpec, render_prompt
from layerbus.models.chat_template import ChatTemplate

# ChatML as SmolLM2 and Qwen write it: the message goes through untouched, so the shortcut applies.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3's way: the content is trimmed, so a document with surrounding whitespace renders differently.
TRIMMING = ("{% for message in messages %}{{ '<|start|>' + message['role'] + '\n\n' + message['content'] | trim + "
            "'<|eot|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant\n\n' }}{% endif %}")
# A template that looks at the content: a message containing "</think>" is cut there.
BRANCHING = ("{% for message in messages %}{% set c = message['content'] %}{% if '</think>' in c %}"
             "{% set c = c.split('</think>')[-1] %}{% endif %}{{ message['role'] + ': ' + c + '\n' }}{% endfor %}")
DOCUMENTS = ("A plain document.", "  padded document \n", "has </think> inside", "", "{{ not jinja }}")


@pytest.mark.parametrize(("template", "shortcut"), [(CHATML, True), (TRIMMING, False), (BRANCHING, False),
                                                    ("", False)])
@pytest.mark.parametrize("spec", [TaskSpec("summarize"), TaskSpec("translate", "French")])
def test_the_shortcut_renders_what_rendering_in_full_renders(template, shortcut, spec):
    tokenizer = ChatTemplate(template)
    renderer = PromptRenderer(spec, tokenizer)
    assert (renderer.frame is not None) == shortcut
    for n, document in enumerate(DOCUMENTS):
        record = InputRecord(custom_id=f"d{n}", text=document, prompt=None, messages=None)
        assert renderer.render(record) == render_prompt(record, spec, tokenizer)


def test_generate_items_are_always_rendered_in_full():
    renderer = PromptRenderer(TaskSpec("generate"), ChatTemplate(CHATML))
    assert renderer.frame is None
    record = InputRecord(custom_id="g", text=None, prompt=None, messages=[{"role": "user", "content": " hi "}])
    assert renderer.render(record) == render_prompt(record, TaskSpec("generate"), ChatTemplate(CHATML))
