"""The benchmark corpus: summarization prompts built from the bundled sample documents.

Each of the 40 sample documents (1 to 8 paragraphs) is asked for with several instructions, so
prompt lengths vary with the documents and output lengths vary with the instructions; every
output is meant to end at EOS well before the token limit.
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_CORPUS = Path(__file__).resolve().parent.parent / "examples" / "sample_corpus"
# Instructions a 135M-parameter model answers briefly, so most outputs end at EOS before the
# 128-token limit (as the benchmark's corpus should); longer asks ("a few sentences", "three
# facts") mostly ran into the limit.
INSTRUCTIONS = (
    "Summarize the following document in one sentence.",
    "Write a one-line headline for the following document.",
    "In one short sentence, what is the following document about?",
    "Summarize the following document in one sentence for a child.",
)


def summarization_messages(count: int) -> list[tuple[str, list[dict]]]:
    """`count` (id, chat messages) pairs cycling documents and instructions."""
    documents = sorted(SAMPLE_CORPUS.glob("*.txt"))
    if not documents:
        raise FileNotFoundError(f"no sample documents in {SAMPLE_CORPUS}")
    prompts = []
    for i in range(count):
        document = documents[i % len(documents)]
        instruction = INSTRUCTIONS[(i // len(documents)) % len(INSTRUCTIONS)]
        text = document.read_text().strip()
        prompts.append((f"{document.stem}-{i}", [{"role": "user", "content": f"{instruction}\n\n{text}"}]))
    return prompts


def tokenized_prompts(tokenizer, count: int) -> list[tuple[str, list[int]]]:
    return _tokenized(tokenizer, summarization_messages(count))


def _tokenized(tokenizer, messages_list) -> list[tuple[str, list[int]]]:
    out = []
    for prompt_id, messages in messages_list:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append((prompt_id, tokenizer(text, add_special_tokens=False).input_ids))
    return out


# Dense work: prompts of similar length whose answers run to the token limit (few end early), the
# case where `generate` with length-sorted batches wastes nothing on padding or finished rows.
STORY_SUBJECTS = (
    "a lighthouse keeper", "a lost robot", "a baker in a small town", "two rival chess players", "a dragon who "
    "cannot fly", "a girl who talks to trees", "an old sailor", "a city under the sea", "a clockmaker",
    "a detective cat", "a forgotten library", "a time-travelling student", "a mountain village", "a space station "
    "cook", "a shy giant", "a musician without a voice",
)
STORY_TWISTS = (
    "Describe every day of one long week in detail.", "Tell it slowly, with many details about the places.",
    "Include long conversations between the characters.", "Describe the seasons changing, one by one.",
)


def story_messages(count: int) -> list[tuple[str, list[dict]]]:
    """`count` (id, chat messages) pairs asking for long stories: similar prompt lengths, long outputs."""
    prompts = []
    for i in range(count):
        subject = STORY_SUBJECTS[i % len(STORY_SUBJECTS)]
        twist = STORY_TWISTS[(i // len(STORY_SUBJECTS)) % len(STORY_TWISTS)]
        text = f"Write a long story about {subject}. {twist} Story number {i + 1}."
        prompts.append((f"story-{i}", [{"role": "user", "content": text}]))
    return prompts


def tokenized_stories(tokenizer, count: int) -> list[tuple[str, list[int]]]:
    return _tokenized(tokenizer, story_messages(count))
