"""What a job asks of the model, and the exact text each item becomes before it is tokenized."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from layerbus.jobs.records import InputRecord

# Every task a job can run, as spelled on the command line (--task).
TASKS = ("summarize", "translate", "generate")


@dataclass(frozen=True)
class TaskSpec:
    """The job's task, checked once when the job is submitted."""

    # One of TASKS.
    task: str
    # Language to translate into, as the user wrote it ("French", "Brazilian Portuguese"); translate only.
    target_language: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}: choose --task {', '.join(TASKS)}")
        if self.task == "translate" and (self.target_language is None or not self.target_language.strip()):
            raise ValueError("--task translate needs a language to translate into: pass --target-language, "
                             "e.g. --target-language French")
        if self.task != "translate" and self.target_language is not None:
            # Accepting it silently would let a user believe their summaries come out translated.
            raise ValueError(f"--target-language {self.target_language!r} only applies to --task translate, "
                             f"not --task {self.task}: drop it, or use --task translate")


@dataclass(frozen=True)
class RenderedPrompt:
    """The text to tokenize for one item, and how to tokenize it."""

    # Exactly what goes to the tokenizer.
    text: str
    # Whether the tokenizer should add its special tokens (BOS, ...). False after a chat template, which
    # writes them itself: adding them again would give the model a doubled BOS it never saw in training.
    add_special_tokens: bool


def instruction(record: InputRecord, spec: TaskSpec) -> str:
    """The user message a summarize or translate item becomes."""
    if spec.task == "summarize":
        return f"Summarize the following document in a few sentences.\n\n{record.text}"
    language = spec.target_language
    return f"Translate the following text into {language}. Reply with the translation only.\n\n{record.text}"


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(record: InputRecord, spec: TaskSpec, tokenizer: Any) -> RenderedPrompt:
    """The exact prompt for one item: through the chat template when the tokenizer has one.

    A raw prompt (generate with prompt) goes to the model as is, with the tokenizer's special tokens added,
    as a completions endpoint does. Without a chat template, summarize and translate fall back to a plain
    instruction ending in "Summary:" or "Translation:", which base models continue well enough.
    """
    if spec.task == "generate":
        if record.prompt is not None:
            return RenderedPrompt(record.prompt, add_special_tokens=True)
        if record.messages is None:
            raise ValueError(f"item {record.custom_id!r} has neither prompt nor messages; --task generate needs one")
        if not has_chat_template(tokenizer):
            raise ValueError(f"item {record.custom_id!r} has chat messages but the model's tokenizer has no chat "
                             "template: give the item a prompt instead, or use a model with a chat template")
        return _chat(tokenizer, record.messages)
    if record.text is None:
        raise ValueError(f"item {record.custom_id!r} has no text; --task {spec.task} needs the document as text")
    user_message = instruction(record, spec)
    if has_chat_template(tokenizer):
        return _chat(tokenizer, [{"role": "user", "content": user_message}])
    answer_label = "Summary:" if spec.task == "summarize" else "Translation:"
    return RenderedPrompt(f"{user_message}\n\n{answer_label}", add_special_tokens=True)


def render_message(message: str, task: str, tokenizer: Any) -> RenderedPrompt:
    """A user message the job wrote itself (a long document's reduce), rendered as summarize and translate
    prompts are: through the chat template, or as a plain instruction ending in its answer label."""
    if has_chat_template(tokenizer):
        return _chat(tokenizer, [{"role": "user", "content": message}])
    answer_label = "Summary:" if task == "summarize" else "Translation:"
    return RenderedPrompt(f"{message}\n\n{answer_label}", add_special_tokens=True)


def _chat(tokenizer: Any, messages: list[dict]) -> RenderedPrompt:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return RenderedPrompt(text, add_special_tokens=False)
