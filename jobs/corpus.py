"""Prompts from a corpus, for measurements that score a model on real text (`layerbus wire-quality`):
the bundled sample corpus or a folder of documents rendered as summarize tasks, or a plain-text file."""

from __future__ import annotations

from pathlib import Path

from layerbus.jobs.records import InputRecord
from layerbus.jobs.tasks import TaskSpec, render_prompt

SAMPLE_CORPUS = Path(__file__).resolve().parent.parent / "examples" / "sample_corpus"


def corpus_prompts(tokenizer, corpus: Path | None = None, max_tokens: int = 2048) -> list[list[int]]:
    """Token ids to score. Default: the bundled sample corpus, each document rendered as a summarize
    prompt (through the chat template when there is one). A folder takes its .txt files as
    documents; a file is plain text, split at blank lines into chunks of at most max_tokens."""
    if corpus is None or corpus.is_dir():
        folder = corpus or SAMPLE_CORPUS
        documents = sorted(folder.glob("*.txt"))
        if not documents:
            raise FileNotFoundError(f"no .txt documents in {folder}")
        prompts = []
        for path in documents:
            record = InputRecord(custom_id=path.stem, text=path.read_text().strip(), prompt=None, messages=None)
            rendered = render_prompt(record, TaskSpec("summarize"), tokenizer)
            ids = tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens).input_ids
            prompts.append(ids[:max_tokens])
        return prompts
    ids = tokenizer(corpus.read_text()).input_ids
    return [ids[i:i + max_tokens] for i in range(0, len(ids), max_tokens) if len(ids[i:i + max_tokens]) > 1]
