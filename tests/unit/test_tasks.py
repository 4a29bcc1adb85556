"""Tasks: checking --task/--target-language, and the exact prompt text each item becomes.

The tokenizer is built here from a few sentences with the `tokenizers` library: nothing is downloaded.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from layerbus.jobs.records import InputRecord
from layerbus.jobs.tasks import TASKS, RenderedPrompt, TaskSpec, render_prompt

# A minimal chat template in the usual shape: BOS, one block per message, then the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def tiny_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer that adds BOS when asked to add special tokens, as Llama-style ones do."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the ferry leaves at noon", "summarize the following document in a few sentences"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    wrapped.chat_template = chat_template
    return wrapped


@pytest.fixture
def chat_tokenizer():
    return tiny_tokenizer(CHAT_TEMPLATE)


@pytest.fixture
def plain_tokenizer():
    return tiny_tokenizer(None)


def document(text: str = "The ferry leaves at noon.") -> InputRecord:
    return InputRecord("d1", text, None, None, {}, "in.jsonl", 1)


# ---- TaskSpec ----


def test_task_spec_accepts_each_task():
    assert TASKS == ("summarize", "translate", "generate")
    assert TaskSpec("summarize").target_language is None
    assert TaskSpec("translate", "French").target_language == "French"
    assert TaskSpec("generate").task == "generate"


@pytest.mark.parametrize(
    "task, language, expected",
    [
        ("classify", None, "unknown task 'classify': choose --task summarize, translate, generate"),
        ("translate", None, "--task translate needs a language to translate into: pass --target-language"),
        ("translate", "  ", "pass --target-language"),
        ("summarize", "French", "--target-language 'French' only applies to --task translate"),
    ],
)
def test_task_spec_refuses_with_the_option_to_use(task, language, expected):
    with pytest.raises(ValueError) as raised:
        TaskSpec(task, language)
    assert expected in str(raised.value)


# ---- render_prompt with a chat template ----


def test_summarize_goes_through_the_chat_template(chat_tokenizer):
    rendered = render_prompt(document(), TaskSpec("summarize"), chat_tokenizer)
    assert rendered == RenderedPrompt(
        "<s><|user|>\nSummarize the following document in a few sentences.\n\n"
        "The ferry leaves at noon.</s>\n<|assistant|>\n",
        add_special_tokens=False,
    )


def test_translate_names_the_target_language(chat_tokenizer):
    rendered = render_prompt(document(), TaskSpec("translate", "Portuguese"), chat_tokenizer)
    assert rendered.text == (
        "<s><|user|>\nTranslate the following text into Portuguese. Reply with the translation only.\n\n"
        "The ferry leaves at noon.</s>\n<|assistant|>\n"
    )
    assert rendered.add_special_tokens is False


def test_chat_prompts_tokenize_with_exactly_one_bos(chat_tokenizer):
    rendered = render_prompt(document(), TaskSpec("summarize"), chat_tokenizer)
    ids = chat_tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens).input_ids
    bos = chat_tokenizer.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1
    # What the flag prevents: tokenizing with the default adds a second BOS in front of the template's.
    assert chat_tokenizer(rendered.text).input_ids[:2] == [bos, bos]


def test_generate_messages_go_through_the_chat_template(chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    record = InputRecord("g1", None, None, messages, {}, "in.jsonl", 1)
    rendered = render_prompt(record, TaskSpec("generate"), chat_tokenizer)
    assert rendered == RenderedPrompt(
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHello</s>\n<|assistant|>\n", add_special_tokens=False
    )


def test_generate_prompt_goes_to_the_model_as_is(chat_tokenizer):
    record = InputRecord("g2", None, "Once upon a time", None, {}, "in.jsonl", 1)
    rendered = render_prompt(record, TaskSpec("generate"), chat_tokenizer)
    assert rendered == RenderedPrompt("Once upon a time", add_special_tokens=True)


# ---- render_prompt without a chat template ----


def test_summarize_without_chat_template_falls_back_to_plain_text(plain_tokenizer):
    rendered = render_prompt(document(), TaskSpec("summarize"), plain_tokenizer)
    assert rendered == RenderedPrompt(
        "Summarize the following document in a few sentences.\n\nThe ferry leaves at noon.\n\nSummary:",
        add_special_tokens=True,
    )


def test_translate_without_chat_template_ends_with_translation_label(plain_tokenizer):
    rendered = render_prompt(document(), TaskSpec("translate", "German"), plain_tokenizer)
    assert rendered.text.startswith("Translate the following text into German.")
    assert rendered.text.endswith("\n\nTranslation:") and rendered.add_special_tokens


def test_generate_messages_without_chat_template_is_refused(plain_tokenizer):
    record = InputRecord("g3", None, None, [{"role": "user", "content": "Hi"}], {}, "in.jsonl", 1)
    with pytest.raises(ValueError, match="'g3' has chat messages but the model's tokenizer has no chat template"):
        render_prompt(record, TaskSpec("generate"), plain_tokenizer)


def test_a_record_without_the_tasks_content_is_refused(chat_tokenizer):
    prompt_only = InputRecord("x", None, "raw", None, {}, "in.jsonl", 1)
    with pytest.raises(ValueError, match="'x' has no text; --task summarize needs the document as text"):
        render_prompt(prompt_only, TaskSpec("summarize"), chat_tokenizer)
    with pytest.raises(ValueError, match="neither prompt nor messages"):
        render_prompt(document(), TaskSpec("generate"), chat_tokenizer)
