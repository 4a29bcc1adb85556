"""Reading each input kind from disk: JSON Lines, CSV and TSV, and a directory of .txt files (Parquet and Arrow
are in jobs/arrow_inputs.py).

Each reader returns the items it found (valid or not) and the problems that concern the whole file. A
whole-file problem in a JSONL, CSV or Parquet input (undecodable CSV, unknown column) means no item is
read from it, so --skip-invalid can never queue a part of a file that was misread.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path

from layerbus.jobs.columns import NO_COLUMNS, ColumnMap
from layerbus.jobs.item_checks import ItemOutcome, check_id, make_record
from layerbus.jobs.jsonl_items import JsonlColumns, parse_jsonl_line
from layerbus.jobs.records import InputProblem
from layerbus.jobs.table_items import csv_values, row_outcome, table_columns

# What a reader returns: every item it found (valid or not), and the problems that concern the whole input.
Found = tuple[list[ItemOutcome], list[InputProblem]]

_UTF8_BOM = b"\xef\xbb\xbf"


def _whole_file(path: Path, message: str, line: int = 0) -> Found:
    return [], [InputProblem(str(path), line, message)]


def _utf8_error(data: bytes, error: UnicodeDecodeError) -> str:
    line = data[: error.start].count(b"\n") + 1
    return f"not valid UTF-8: byte 0x{data[error.start]:02x} on line {line}; save the file as UTF-8"


def read_jsonl(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Found:
    """One item per non-blank line; a bad line is refused on its own and reading goes on."""
    found = list(jsonl_outcomes(path, task, columns))
    problems = [f for f in found if isinstance(f, InputProblem)]
    return ([] if problems else found), problems  # type: ignore[return-value]


def jsonl_outcomes(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Iterator[ItemOutcome | InputProblem]:
    """read_jsonl one line at a time, for inputs too large to hold: each item's outcome as its line is read.

    A whole-file problem comes as an InputProblem (possibly after items): then no item of the file counts.
    The keys a simple-form line is read by are chosen at its first simple-form line (JsonlColumns).
    """
    count, keys = 0, JsonlColumns(task, columns)
    try:
        with path.open("rb") as lines:
            for number, data in enumerate(lines, start=1):
                data = data.removeprefix(_UTF8_BOM) if number == 1 else data
                data = data.rstrip(b"\r\n")
                try:
                    raw = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raw = data.decode("utf-8", errors="replace")
                    outcome = ItemOutcome(str(path), number, raw, f"line {number}", f"line-{number}")
                    message = f"not valid UTF-8: byte 0x{data[e.start]:02x} at column {e.start + 1}"
                    count += 1
                    yield outcome.refuse([message])
                    continue
                if not raw.strip():
                    continue  # blank lines (a trailing newline, a spacer) hold no item
                if not count and raw.lstrip().startswith("["):
                    yield InputProblem(str(path), 0, "starts with '[', so it looks like one JSON array; inputs are "
                                                     "JSON Lines, one object per line (convert with: jq -c '.[]' IN "
                                                     "> OUT.jsonl)")
                    return
                count += 1
                outcome = parse_jsonl_line(raw, task, str(path), number, keys)
                if keys.problem is not None:
                    yield InputProblem(str(path), 0, keys.problem)
                    return
                yield outcome
    except OSError as e:
        yield InputProblem(str(path), 0, f"cannot read: {e.strerror or e}")
        return
    if not count:
        yield InputProblem(str(path), 0, 'file is empty: write one JSON object per line, e.g. {"id": "doc-1", '
                                         '"text": "..."}')


def read_csv(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Found:
    """A header line, then one item per row; the row's line number is the line its first cell starts on."""
    return _read_delimited(path, task, columns, ",")


def read_tsv(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Found:
    """As read_csv, with cells separated by tabs."""
    return _read_delimited(path, task, columns, "\t")


def _read_delimited(path: Path, task: str, columns: ColumnMap, delimiter: str) -> Found:
    kind = "CSV" if delimiter == "," else "TSV"
    try:
        data = path.read_bytes()
    except OSError as e:
        return _whole_file(path, f"cannot read: {e.strerror or e}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return _whole_file(path, _utf8_error(data, e))
    # newline="" keeps line endings inside quoted cells, as the csv module requires.
    lines = io.StringIO(text, newline="").readlines()
    reader = csv.reader(iter(lines), strict=True, delimiter=delimiter)
    rows, end = [], 0
    try:
        for cells in reader:
            start, end = end + 1, reader.line_num
            if cells:
                rows.append((start, end, cells))
    except csv.Error as e:
        return _whole_file(path, f"cannot parse as {kind}: {e} (an unbalanced quote?)", reader.line_num)
    if not rows:
        return _whole_file(path, f"file is empty: a {kind} input needs a header line such as id,text and one row "
                                 "per item")
    (_, _, header), rows = rows[0], rows[1:]
    names = [name.strip() for name in header]
    chosen, reasons = table_columns(names, task, columns, header_line=True)
    if chosen is None:
        return [], [InputProblem(str(path), 1, reason) for reason in reasons]
    if not rows:
        return _whole_file(path, "no items: the file has a header line but no rows")
    return [_csv_row(path, task, names, chosen, lines, *row) for row in rows], []


def _csv_row(path: Path, task: str, names: list[str], columns: ColumnMap, lines: list[str], start: int, end: int,
             cells: list[str]):
    raw = "".join(lines[start - 1 : end]).rstrip("\r\n")
    outcome = ItemOutcome(str(path), start, raw, f"line {start}", f"line-{start}")
    if len(cells) != len(names):
        message = (f"row has {len(cells)} field(s) but the header has {len(names)}; "
                   "quote any text that holds a comma")
        return outcome.refuse([message])
    return row_outcome(csv_values(names, cells), columns, task, str(path), outcome)


def read_text_dir(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Found:
    """One item per .txt file directly inside: id = file name without extension, text = content.

    Hidden files (".DS_Store", editor swap files) are ignored; any other non-.txt entry is reported, since
    it is most likely a document the user expected to be read.
    """
    if columns.named():
        options = ", ".join(f"--{role}-column" for role in columns.named())
        return _whole_file(path, f"a folder of .txt files has no columns (each file is one document, its name the "
                                 f"id): drop {options}")
    try:
        entries = sorted((e for e in path.iterdir() if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as e:
        return _whole_file(path, f"cannot list directory: {e.strerror or e}")
    if not entries:
        return _whole_file(path, "directory is empty: put one UTF-8 .txt file per document in it")
    problems, texts = [], []
    for entry in entries:
        if entry.is_dir():
            problems.append(InputProblem(str(entry), 0, "subdirectory: only .txt files directly inside are read"))
        elif entry.suffix.lower() != ".txt":
            problems.append(InputProblem(str(entry), 0, "not a .txt file: move it out, or rename it if it is text"))
        else:
            texts.append(entry)
    if not texts:
        problems.append(InputProblem(str(path), 0, "no .txt files in this directory"))
    return [_text_file(entry, index, task) for index, entry in enumerate(texts, start=1)], problems


def _text_file(entry: Path, index: int, task: str) -> ItemOutcome:
    outcome = ItemOutcome(str(entry), index, "", f"file {entry.name}", f"file-{index}", whole_file=True)
    custom_id, reasons = check_id(entry.stem, "file name")
    try:
        data = entry.read_bytes()
        # A file's final newline is a file convention, not part of the document: dropping it makes the
        # .txt and JSONL forms of one corpus render identical prompts.
        outcome.raw = data.decode("utf-8-sig").rstrip("\r\n")
    except OSError as e:
        reasons.append(f"cannot read: {e.strerror or e}")
    except UnicodeDecodeError as e:
        outcome.raw = data.decode("utf-8", errors="replace")
        reasons.append(_utf8_error(data, e))
    if not reasons and not outcome.raw.strip():
        reasons.append("file is empty")
    if not reasons:
        record, reasons = make_record(task, custom_id, {"text": outcome.raw}, {}, str(entry), index)
        outcome.record = record
    outcome.custom_id = custom_id
    return outcome.refuse(reasons)
