"""Two runs' samples rows paired document by document, after checking the runs asked the model the same things.

A paired comparison is only meaningful when both runs scored the same documents with the same prompts: a
changed task file, few-shot setting or tokenizer changes what is asked, and a difference in the scores
would then say nothing about the model. Each samples row carries prompt_hash (items.prompt_hash), so the
check is exact: every (task, doc_id) must be in both runs with the same hash, or the comparison is refused
with NotComparableError naming a few of the documents. The filter is not part of a document's prompt
(a generation task has one row per filter, all with the document's hash): filters only decide which
metrics exist, and a metric in one run only is left out by compare_runs, not refused here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# Documents named per problem in a NotComparableError before "and N more".
NAMED_DOCS = 5


@dataclass(frozen=True)
class RowKey:
    """Where a samples row sits: one document of one task under one filter."""

    task: str
    filter: str
    doc_id: str


@dataclass(frozen=True)
class PairedRows:
    """The rows of one task and filter present in both runs, in the base run's document order."""

    task: str
    filter: str
    # (base row, candidate row) per document.
    pairs: tuple[tuple[Mapping, Mapping], ...]


class NotComparableError(ValueError):
    """The runs asked different things: documents missing from one run, or prompts that differ."""

    def __init__(self, changed: Sequence[tuple[str, str]], base_only: Sequence[tuple[str, str]],
                 cand_only: Sequence[tuple[str, str]], base_label: str, cand_label: str):
        # (task, doc_id) of each document whose prompt hash differs, is only in the base run, only in the candidate.
        self.changed, self.base_only, self.cand_only = list(changed), list(base_only), list(cand_only)
        count = len(self.changed) + len(self.base_only) + len(self.cand_only)
        parts = [f"{len(docs)} {what} ({_name_docs(docs)})" for what, docs in (
            ("changed", self.changed), (f"only in {base_label}", self.base_only),
            (f"only in {cand_label}", self.cand_only)) if docs]
        super().__init__(
            f"not comparable: {count} {'prompts differ' if count != 1 else 'prompt differs'} between {base_label} and "
            f"{cand_label}: {', '.join(parts)}. The task files, few-shot settings, --limit or tokenizer changed "
            "between the runs; "
            "compare two runs made with the same ones (`layerbus eval history SUITE` lists a suite's runs and "
            "their fingerprints)")


def _name_docs(docs: Sequence[tuple[str, str]]) -> str:
    """'task a: doc-1, doc-2; task b: doc-9, and 12 more' for the first NAMED_DOCS documents."""
    by_task: dict[str, list[str]] = {}
    for task, doc_id in docs[:NAMED_DOCS]:
        by_task.setdefault(task, []).append(doc_id)
    named = "; ".join(f"task {task!r}: {', '.join(ids)}" for task, ids in by_task.items())
    return named + (f"; and {len(docs) - NAMED_DOCS} more" if len(docs) > NAMED_DOCS else "")


def _prompts(rows: Iterable[Mapping]) -> dict[tuple[str, str], str | None]:
    """(task, doc_id) -> prompt_hash, in row order (a document's filters share its hash)."""
    found: dict[tuple[str, str], str | None] = {}
    for row in rows:
        found.setdefault((row["task"], row["doc_id"]), row["prompt_hash"])
    return found


def check_comparable(base_rows: Sequence[Mapping], cand_rows: Sequence[Mapping], base_label: str = "the base run",
                     cand_label: str = "the candidate run") -> None:
    """NotComparableError unless both runs hold the same documents with the same prompt hashes."""
    base, cand = _prompts(base_rows), _prompts(cand_rows)
    changed = [key for key, hash_ in base.items() if key in cand and cand[key] != hash_]
    base_only = [key for key in base if key not in cand]
    cand_only = [key for key in cand if key not in base]
    if changed or base_only or cand_only:
        raise NotComparableError(changed, base_only, cand_only, base_label, cand_label)


def pair_rows(base_rows: Sequence[Mapping], cand_rows: Sequence[Mapping]) -> dict[tuple[str, str], PairedRows]:
    """(task, filter) -> its paired rows, for the rows of a (task, filter, doc_id) found in both runs.

    Call check_comparable first: pairing itself does not look at prompts."""
    cand = {RowKey(r["task"], r["filter"], r["doc_id"]): r for r in cand_rows}
    grouped: dict[tuple[str, str], list[tuple[Mapping, Mapping]]] = {}
    for row in base_rows:
        other = cand.get(RowKey(row["task"], row["filter"], row["doc_id"]))
        if other is not None:
            grouped.setdefault((row["task"], row["filter"]), []).append((row, other))
    return {key: PairedRows(key[0], key[1], tuple(pairs)) for key, pairs in grouped.items()}
