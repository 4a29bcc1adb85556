"""Reading a task file (JSONL or Parquet, one document per row) into typed documents, with every problem found in one pass.

A folder of .txt files is a rolling (perplexity, bits-per-byte) task: one document per file, as `layerbus
submit` reads such a folder (id = file name without .txt, final newline dropped), so a corpus needs no copy.

A file holds one kind of document, told by the fields of its rows (see task_rows.py); the first row whose kind
can be told sets it. Ids are unique within a file. Any problem refuses the whole file: an eval scored on the
rows that happened to be valid would not be comparable with the next night's run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from layerbus.evals.documents import KIND_NAMES, Document, TaskFileError, TaskProblem
from layerbus.evals.task_rows import check_row, row_kind, show, type_name

ACCEPTED = ("accepted: a .jsonl file (one JSON object per line), a .parquet file (one document per row), or a folder "
            "of .txt files (one rolling document each)")


@dataclass(frozen=True)
class TaskFile:
    """The documents of one valid task file."""

    # Path as given by the user.
    source: str
    # One of documents.KINDS; every document is of this kind.
    kind: str
    # In file order.
    docs: tuple[Document, ...]


def load_task_file(path: str | Path) -> TaskFile:
    """Read and check the task file at path; raises TaskFileError naming every problem."""
    source = str(path)
    path = Path(path)
    suffix = path.suffix.lower()
    if not path.exists():
        raise TaskFileError([TaskProblem(source, 0, f"does not exist; {ACCEPTED}")])
    if path.is_dir():
        rows = _text_folder_rows(path)
    elif suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path.read_text(encoding="utf-8"))
    elif suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise TaskFileError([TaskProblem(source, 0, f"unknown task file kind {suffix or '(no extension)'!r}; {ACCEPTED}")])
    return check_rows(rows, source)


def check_rows(rows: Iterable[tuple[int, dict | str]], source: str) -> TaskFile:
    """Documents from (line, row) pairs; a str row is a problem the reader found already (bad JSON...)."""
    docs: list[Document] = []
    problems: list[TaskProblem] = []
    file_kind: tuple[str, int] | None = None  # (kind, line that set it)
    first_line_of: dict[str, int] = {}
    for line, row in rows:
        if isinstance(row, str):
            problems.append(TaskProblem(source, line, row))
            continue
        kind, reasons = row_kind(row)
        if kind and file_kind is None:
            file_kind = (kind, line)
        elif kind and kind != file_kind[0]:
            reasons = [f"the row is {KIND_NAMES[kind]} but line {file_kind[1]} made the file "
                       f"{KIND_NAMES[file_kind[0]]}; one task file holds one kind: split it into two files"]
        doc = None
        if not reasons:
            doc, reasons = check_row(row, kind)
        reasons += _duplicate_id(row.get("id"), line, first_line_of)
        problems += [TaskProblem(source, line, reason) for reason in reasons]
        if doc is not None and not reasons:
            docs.append(doc)
    if not problems and not docs:
        problems.append(TaskProblem(source, 0, "no documents found"))
    if problems:
        raise TaskFileError(problems)
    return TaskFile(source=source, kind=file_kind[0], docs=tuple(docs))


def _duplicate_id(value: object, line: int, first_line_of: dict[str, int]) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return []
    key = str(value)
    first = first_line_of.setdefault(key, line)
    return [] if first == line else [f"duplicate id {show(key)}: line {first} has it already"]


def _jsonl_rows(text: str) -> Iterator[tuple[int, dict | str]]:
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            yield line, f"malformed JSON: {e.msg} at column {e.colno}"
            continue
        if not isinstance(row, dict):
            yield line, f"expected a JSON object, got {type_name(row)}"
            continue
        yield line, {k: v for k, v in row.items() if v is not None}


def _text_folder_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """One {id, text} row per .txt file directly inside, in name order; row numbers count those files."""
    entries = sorted((e for e in path.iterdir() if not e.name.startswith(".")), key=lambda e: e.name)
    texts = [e for e in entries if e.is_file() and e.suffix.lower() == ".txt"]
    for number, entry in enumerate(texts, start=1):
        try:
            # The final newline is a file convention, not part of the document (as layerbus submit reads it).
            yield number, {"id": entry.stem, "text": entry.read_bytes().decode("utf-8-sig").rstrip("\r\n")}
        except UnicodeDecodeError as e:
            yield number, f"{entry.name} is not UTF-8 ({e.reason} at byte {e.start}); save it as UTF-8"
    if not texts:
        yield 0, "no .txt files in this folder (a folder task is one rolling document per .txt file)"


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    import pyarrow.parquet as pq  # only Parquet task files need it

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet; all mean the same
        yield 0, f"cannot be read as Parquet ({type(e).__name__}: {e})"
        return
    for row_number, row in enumerate(table.to_pylist(), start=1):
        yield row_number, {k: v for k, v in row.items() if v is not None}
