"""At submit: a document whose prompt does not fit the context with its output budget is split into the items
of a tree (jobs/long_documents.py), cut to fit (truncate), or left to fail as it is (fail).

Only documents that could be long are measured: a prompt of B bytes has at most B tokens (a byte-level
tokenizer's token is at least a byte; one more for a leading space marker), so a prompt whose bytes fit
needs no tokenizer and takes exactly the path it always took. The tokenizer (the model's
tokenizer.json, through the `tokenizers` package: no torch) is loaded only when one does not.

The items of a split document (storage/document_parts.py runs them):
- its pieces `ID#map-K` (summarize) or `ID#piece-K` (translate), level 0, queued;
- for summarize, the reduces `ID#reduce-L-K` of each level below the top, waiting;
- the document's own item `ID`, at its own place in the input: the top reduce (summarize) or the join
  of the pieces (translate), waiting. Its input is the whole document, its result the document's.
Parts are numbered after every input line (PART_SEQ_BASE up), so the document's own item keeps its
place and seed, and the parts are claimed after the documents that fit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from layerbus.jobs.item_params import item_params
from layerbus.jobs.long_documents import REDUCE_TEMPLATE, reduce_fan_in, reduce_prompt_text, reduce_tree, split_text
from layerbus.jobs.prompts import PromptRenderer
from layerbus.jobs.records import InputRecord
from layerbus.jobs.tasks import RenderedPrompt
from layerbus.storage.document_parts import JOIN_BEFORE_KEY
from layerbus.storage.records import NewItem

# The first seq of a long document's parts: above any input's line numbers, within a 32-bit column.
PART_SEQ_BASE = 2**30
# Context assumed when the command does not say (`run`'s --max-context default, as brokers start with).
DEFAULT_CONTEXT = 2048
# Tokens kept free in every piece's prompt: the tokenizer may join words across a cut differently.
SLACK_TOKENS = 8
# Fewer tokens of text than this in a piece is no summary's worth: such a document is left as it is.
MIN_PIECE_TOKENS = 16
# The key under JobSettings.extra that holds how the job treats long documents.
EXTRA_KEY = "long_documents"


@dataclass(frozen=True)
class LongDocuments:
    """How one job treats documents whose prompt does not fit."""

    # split, fail or truncate (jobs/long_documents.py LONG_DOCUMENT_MODES).
    mode: str
    # Tokens a prompt and its output must fit in.
    context_tokens: int
    # A document's text over this many tokens is split even when it fits; None: only the context decides.
    max_chunk_tokens: int | None = None
    # Tokens of a piece's text repeated at the start of the next one (summarize only).
    overlap_tokens: int = 0
    # What a reduce asks around the summaries ({summaries} marks where they go).
    reduce_template: str = REDUCE_TEMPLATE
    # What a piece's prompt asks around its text ({document} marks where it goes); None: the task's own
    # instruction, as a whole document's prompt has it.
    map_template: str | None = None

    def to_extra(self) -> dict[str, Any]:
        return {"mode": self.mode, "context_tokens": self.context_tokens, "max_chunk_tokens": self.max_chunk_tokens,
                "overlap_tokens": self.overlap_tokens, "reduce_template": self.reduce_template,
                "map_template": self.map_template}

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> LongDocuments | None:
        given = extra.get(EXTRA_KEY)
        return cls(**given) if given else None


def model_context(model_dir: Path) -> int:
    """The model's own context (config.json's max_position_embeddings), or DEFAULT_CONTEXT when it says none."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CONTEXT
    return int(config.get("max_position_embeddings") or DEFAULT_CONTEXT)


def token_counter(model_dir: Path) -> Callable[[str, bool], int]:
    """Counts a text's tokens with the model's tokenizer, loaded on first use; (text, add_special_tokens)."""
    loaded: list[Any] = []

    def count(text: str, add_special_tokens: bool) -> int:
        if not loaded:
            loaded.append(_load(model_dir))
        return loaded[0](text, add_special_tokens)

    return count


def _load(model_dir: Path) -> Callable[[str, bool], int]:
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(tokenizer_file))
        return lambda text, special: len(fast.encode(text, add_special_tokens=special).ids)
    from layerbus.models.model_info import load_tokenizer

    slow = load_tokenizer(model_dir)
    return lambda text, special: len(slow.encode(text, add_special_tokens=special, verbose=False))


class DocumentSplitter:
    """The items one document of a summarize or translate job becomes."""

    def __init__(self, policy: LongDocuments, task: str, renderer: PromptRenderer, max_new_tokens: int,
                 count: Callable[[str, bool], int]) -> None:
        self.policy, self.task, self.renderer = policy, task, renderer
        self.max_new_tokens, self.count = max_new_tokens, count
        self.next_seq = PART_SEQ_BASE
        # Documents split, and the parts they became: the submit's summary.
        self.split_documents = 0
        self.parts = 0

    def items(self, record: InputRecord, item: NewItem) -> list[NewItem]:
        """[item] when its prompt fits (or the output budget leaves no room for pieces); else the split
        document's items, or with truncate its item cut to its first piece."""
        max_new = int(item.params.get("max_tokens", self.max_new_tokens))
        budget = self.policy.context_tokens - max_new
        if self.policy.mode == "fail" or record.text is None or self._surely_fits(item, record, budget):
            return [item]
        special = bool(item.params.get("add_special_tokens", False))
        text_tokens = self.count(record.text, False)
        over_chunk = self.policy.max_chunk_tokens is not None and text_tokens > self.policy.max_chunk_tokens
        if not over_chunk and self.count(item.prompt or "", special) <= budget:
            return [item]
        frame = self.count(self._render(record, "").text, special)
        piece_budget = min(budget - frame - SLACK_TOKENS, self.policy.max_chunk_tokens or budget)
        if piece_budget < MIN_PIECE_TOKENS:
            # The output budget leaves no room for a piece's text: the item runs as it always has (the
            # scheduler cuts its output at the context, or fails a prompt longer than the context).
            return [item]
        pieces = split_text(record.text, lambda text: self.count(text, False), piece_budget,
                            self.policy.overlap_tokens if self.task == "summarize" else 0)
        if self.policy.mode == "truncate":
            return [replace(self._item(record, item, pieces[0].text, item.custom_id, item.seq, {}), input=item.input)]
        return self._tree(record, item, pieces, max_new, budget, special)

    def _surely_fits(self, item: NewItem, record: InputRecord, budget: int) -> bool:
        chunk = self.policy.max_chunk_tokens
        if chunk is not None and len(record.text.encode()) + 1 > chunk:
            return False
        return len((item.prompt or "").encode()) + 1 <= budget

    def _tree(self, record: InputRecord, item: NewItem, pieces: list, max_new: int, budget: int,
              special: bool) -> list[NewItem]:
        doc = item.custom_id
        params = item.params  # the document's own: its max_tokens, seed, ... hold for each of its parts
        label = "map" if self.task == "summarize" else "piece"
        parts: list[NewItem] = []
        levels = self._levels(len(pieces), max_new, budget, special)
        top = len(levels)
        names = [[f"{doc}#reduce-{level}-{k}" for k in range(len(sizes))] for level, sizes in enumerate(levels, 1)]
        names[-1] = [doc]
        parents = _parents(levels, names)
        for k, piece in enumerate(pieces):
            extra = {JOIN_BEFORE_KEY: piece.join_before} if self.task == "translate" and k else {}
            made = self._item(record, item, piece.text, f"{doc}#{label}-{k}", self._seq(), extra)
            parts.append(replace(made, parent_id=parents[0][k][0], position=parents[0][k][1], level=0))
        for level in range(1, top):
            for k, name in enumerate(names[level - 1]):
                parent, position = parents[level][k]
                parts.append(NewItem(name, "", None, params, self._seq(), parent_id=parent, position=position,
                                     level=level, combine="reduce"))
        combine = "reduce" if self.task == "summarize" else "join"
        root = NewItem(doc, record.text, None, params, item.seq, level=top, combine=combine)
        self.split_documents += 1
        self.parts += len(parts)
        return [root, *parts]

    def _levels(self, pieces: int, max_new: int, budget: int, special: bool) -> list[list[int]]:
        if self.task != "summarize":
            return [[pieces]]  # one join over every piece
        frame = self.count(self.renderer.render_message(reduce_prompt_text([], self.policy.reduce_template)).text,
                           special)
        return reduce_tree(pieces, reduce_fan_in(budget - SLACK_TOKENS, frame, max_new))

    def _render(self, record: InputRecord, text: str) -> RenderedPrompt:
        if self.policy.map_template is None:
            return self.renderer.render(replace(record, text=text))
        return self.renderer.render_message(self.policy.map_template.replace("{document}", text))

    def _item(self, record: InputRecord, item: NewItem, text: str, custom_id: str, seq: int,
              extra: dict[str, Any]) -> NewItem:
        prompt = self._render(record, text)
        params = {**item_params(record.params, prompt.add_special_tokens, record.endpoint), **extra}
        return NewItem(custom_id, text, prompt.text, params, seq)

    def _seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1


def _parents(levels: list[list[int]], names: list[list[str]]) -> list[list[tuple[str, int]]]:
    """For each level from the pieces up, each node's (parent's name, place among its parent's parts)."""
    out = []
    for sizes, level_names in zip(levels, names):
        nodes = []
        for size, name in zip(sizes, level_names):
            nodes += [(name, position) for position in range(size)]
        out.append(nodes)
    return out
