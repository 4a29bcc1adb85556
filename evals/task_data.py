"""Reading one data file of a task YAML (dataset_path json, csv or parquet) into rows, as datasets' loaders give them to lm-eval.

Rows come with their line (JSON Lines, JSON array element, CSV record) or row (Parquet) number so every problem
is reported as `file:line`. Like a datasets split, every row has every column of the file: a key missing from
one JSON row is None there. CSV values are typed per column as pandas (behind datasets' csv loader) types them
for plain data: a column of integers is int, of numbers float, anything else str; an empty cell is None. The
reader follows dataset_path, not the file's extension, as lm-eval does.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from layerbus.evals.documents import TaskFileError, TaskProblem
from layerbus.evals.task_rows import type_name

LOADERS = ("json", "csv", "parquet")


def read_data_file(path: Path, loader: str, source: str | None = None) -> list[tuple[int, dict]]:
    """(line, row) for every row of the file; raises TaskFileError naming every bad line."""
    source = source or str(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TaskFileError([TaskProblem(source, 0, f"cannot read: {e.strerror or e} (data_files paths are "
                                                    "relative to the task YAML's folder)")]) from None
    if loader == "parquet":
        found = _parquet_rows(raw)
    else:
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise TaskFileError([TaskProblem(source, line, f"not UTF-8 (byte {raw[e.start]:#04x}); save the "
                                                           "file as UTF-8")]) from None
        found = _json_rows(text) if loader == "json" else _csv_rows(text)
    problems = [TaskProblem(source, line, row) for line, row in found if isinstance(row, str)]
    rows = [(line, row) for line, row in found if isinstance(row, dict)]
    if not problems and not rows:
        problems.append(TaskProblem(source, 0, "no rows found"))
    if problems:
        raise TaskFileError(problems)
    return _with_every_column(rows)


def _with_every_column(rows: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    columns = list(dict.fromkeys(key for _, row in rows for key in row))
    return [(line, {key: row.get(key) for key in columns}) for line, row in rows]


def _json_rows(text: str) -> list[tuple[int, dict | str]]:
    """A JSON array of objects, or JSON Lines (datasets' json loader reads both)."""
    if text.lstrip().startswith("["):
        return _json_array_rows(text)
    found: list[tuple[int, dict | str]] = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            found.append((line, _object(json.loads(raw))))
        except json.JSONDecodeError as e:
            found.append((line, f"malformed JSON: {e.msg} at column {e.colno}"))
    return found


def _json_array_rows(text: str) -> list[tuple[int, dict | str]]:
    decoder, found = json.JSONDecoder(), []
    position = text.index("[") + 1
    while True:
        position = _skip(text, position, ",")
        if position >= len(text) or text[position] == "]":
            break
        line = text.count("\n", 0, position) + 1
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as e:
            return found + [(e.lineno, f"malformed JSON: {e.msg} at column {e.colno}")]
        found.append((line, _object(value)))
    if position >= len(text) or _skip(text, position + 1, "") < len(text):
        line = text.count("\n", 0, min(position, len(text))) + 1
        found.append((line, "malformed JSON: the array is not closed by a final ]"))
    return found


def _skip(text: str, position: int, separators: str) -> int:
    while position < len(text) and (text[position].isspace() or text[position] in separators):
        position += 1
    return position


def _object(value: object) -> dict | str:
    return value if isinstance(value, dict) else f"expected a JSON object (one row), got {type_name(value)}"


def _csv_rows(text: str) -> list[tuple[int, dict | str]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if not header:
        return [(1, "no header row: the first line names the columns")]
    if len(set(header)) < len(header):
        return [(1, f"the header repeats a column name: {header}")]
    records, found = [], []
    for record in reader:
        if not any(cell.strip() for cell in record):
            continue
        if len(record) != len(header):
            found.append((reader.line_num, f"{len(record)} fields, the header has {len(header)}: quote values "
                                           "that contain commas"))
        else:
            records.append((reader.line_num, record))
    columns = [_typed_column([record[i] for _, record in records]) for i in range(len(header))]
    rows = [(line, {name: columns[i][n] for i, name in enumerate(header)}) for n, (line, _) in enumerate(records)]
    return sorted(found + rows, key=lambda pair: pair[0])


def _typed_column(cells: list[str]) -> list[object]:
    given = [cell for cell in cells if cell != ""]
    for kind in (int, float):
        try:
            typed = {cell: kind(cell) for cell in given}
        except ValueError:
            continue
        return [typed[cell] if cell != "" else None for cell in cells]
    return [cell if cell != "" else None for cell in cells]


def _parquet_rows(raw: bytes) -> list[tuple[int, dict | str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(raw))
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet; all mean the same
        return [(0, f"cannot be read as Parquet ({type(e).__name__}: {e})")]
    return list(enumerate(table.to_pylist(), start=1))
