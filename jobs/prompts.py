"""Rendering a large job's prompts quickly: summarize and translate prompts are the chat template around one
user message, so the template is rendered once around a marker and each item's message is put in its place.

Rendering Jinja per item took ~100 us, most of a million-item submit. The shortcut is taken only where
the template passes a user message through untouched: rendering probe messages (surrounding whitespace,
thinking tags, Jinja-looking text, an empty document) in full must give exactly the frame around them,
or every item is rendered in full as before. Generate items (the user's own messages) always are.
"""

from __future__ import annotations

from typing import Any

from layerbus.jobs.records import InputRecord
from layerbus.jobs.tasks import RenderedPrompt, TaskSpec, has_chat_template, instruction, render_message, render_prompt

# Stands for the user message while the frame is rendered; no document contains it (NUL bytes).
MARKER = "\x00layerbus-user-message\x00"
# Documents a template that trims, escapes, or branches on a message's content would render differently.
PROBE_DOCUMENTS = ("", "  padded  \n", "\n\nlines\n\n", "<think>x</think> {{ y }} {% raw %}", "'\"<|im_end|>\\")


class PromptRenderer:
    """render_prompt for every item of one job, with the frame shortcut where the template allows it."""

    def __init__(self, spec: TaskSpec, tokenizer: Any) -> None:
        self._spec = spec
        self._tokenizer = tokenizer
        # (text before, text after) the user message, or None: render each item in full.
        self.frame = _frame(spec, tokenizer) if spec.task != "generate" and has_chat_template(tokenizer) else None

    def render(self, record: InputRecord) -> RenderedPrompt:
        """What render_prompt(record, spec, tokenizer) returns; ValueError for an item it refuses."""
        if self.frame is None or record.text is None:
            return render_prompt(record, self._spec, self._tokenizer)
        before, after = self.frame
        return RenderedPrompt(before + instruction(record, self._spec) + after, add_special_tokens=False)


    def render_message(self, message: str) -> RenderedPrompt:
        """A user message of the job's own (a long document's reduce), as render_message renders it."""
        if self.frame is None:
            return render_message(message, self._spec.task, self._tokenizer)
        before, after = self.frame
        return RenderedPrompt(before + message + after, add_special_tokens=False)


def _frame(spec: TaskSpec, tokenizer: Any) -> tuple[str, str] | None:
    def chat(content: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)

    framed = chat(MARKER)
    if framed.count(MARKER) != 1:
        return None
    before, after = framed.split(MARKER)
    for document in PROBE_DOCUMENTS:
        message = instruction(InputRecord(custom_id="probe", text=document, prompt=None, messages=None), spec)
        if chat(message) != before + message + after:
            return None
    return before, after
