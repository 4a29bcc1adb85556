"""Reading Parquet and Arrow inputs a record batch at a time, so memory does not grow with the table.

Accepted: a Parquet file or a folder of part files (as Spark and pyarrow write them), an Arrow IPC file
(`.arrow`, stream or file format), and a folder that HF `datasets` wrote with `save_to_disk` (its
`state.json` names its Arrow files). Only the columns an item is read from are read, and a nested field
(`translation.de`) is a dotted name. Rows are numbered from 1 across the whole table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from layerbus.jobs.columns import NO_COLUMNS, PARAM_COLUMNS, ColumnMap
from layerbus.jobs.item_checks import ItemOutcome
from layerbus.jobs.records import InputProblem
from layerbus.jobs.table_items import row_outcome, table_columns

# Rows per record batch: a few MB of documents, and small enough that a batch of books stays bounded.
BATCH_ROWS = 1024
# What a reader returns: every item it found (valid or not), and the problems that concern the whole input.
Found = tuple[list[ItemOutcome], list[InputProblem]]


def is_arrow_folder(path: Path) -> bool:
    """True for a folder HF `datasets` saved (a dataset, or a dict of splits), or a folder of .arrow files."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
                              or any(path.glob("*.arrow")))


def read_parquet(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Found:
    """Every row of a Parquet input, as one list (parquet_outcomes streams them)."""
    return _listed(parquet_outcomes(path, task, columns))


def read_arrow(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Found:
    """Every row of an Arrow input, as one list (arrow_outcomes streams them)."""
    return _listed(arrow_outcomes(path, task, columns))


def parquet_outcomes(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Iterator[ItemOutcome | InputProblem]:
    """Each row's outcome as its batch is read, then any whole-table problem."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # A file is read a batch at a time with no read-ahead; a folder of parts through pyarrow's
        # datasets (which read a few batches ahead, and cost 50 MB to import: only for a folder).
        # buffer_size: a column chunk's pages are read through a 1 MiB buffer, not the whole chunk at once
        # (pandas and pyarrow write row groups of up to a million rows).
        table = pq.ParquetFile(str(path), buffer_size=1 << 20) if path.is_file() else _parquet_folder(path)
        schema = table.schema_arrow if path.is_file() else table.schema
    except (OSError, pa.ArrowException) as e:
        yield InputProblem(str(path), 0, f"cannot read as Parquet: {e}")
        return

    def batches(names: list[str]) -> Iterator:
        if path.is_file():
            yield from table.iter_batches(batch_size=BATCH_ROWS, columns=names, use_threads=False)
        else:
            yield from table.to_batches(columns=names, batch_size=BATCH_ROWS)

    yield from _table_outcomes(path, task, columns, schema, batches, "Parquet")


def _parquet_folder(path: Path):
    import pyarrow.dataset as ds

    return ds.dataset(str(path), format="parquet", partitioning="hive")


def arrow_outcomes(path: Path, task: str, columns: ColumnMap = NO_COLUMNS) -> Iterator[ItemOutcome | InputProblem]:
    """Each row's outcome of an Arrow file or a `save_to_disk` folder, a record batch at a time."""
    import pyarrow as pa

    files, problem = _arrow_files(path)
    if problem is not None:
        yield InputProblem(str(path), 0, problem)
        return
    try:
        schema = _open_ipc(files[0]).schema
    except (OSError, pa.ArrowException) as e:
        yield InputProblem(str(files[0]), 0, f"cannot read as Arrow: {e}")
        return

    def batches(names: list[str]) -> Iterator:
        for file in files:
            for batch in _open_ipc(file):
                yield batch.select(names)

    yield from _table_outcomes(path, task, columns, schema, batches, "Arrow")


def _arrow_files(path: Path) -> tuple[list[Path], str | None]:
    if path.is_file():
        return [path], None
    if (path / "dataset_dict.json").is_file():
        splits = _json_file(path / "dataset_dict.json").get("splits") or []
        example = path / (splits[0] if splits else "train")
        return [], (f"holds a dataset of several splits ({', '.join(map(str, splits))}), as HF datasets' save_to_disk "
                    f"writes a DatasetDict: pass one split's folder, such as {example}")
    state = _json_file(path / "state.json")
    names = [entry.get("filename") for entry in state.get("_data_files", []) if isinstance(entry, dict)]
    files = [path / name for name in names if isinstance(name, str)] or sorted(path.glob("*.arrow"))
    missing = [str(file) for file in files if not file.is_file()]
    if missing or not files:
        return [], f"the dataset's Arrow files are missing ({', '.join(missing) or 'none in the folder'})"
    return files, None


def _json_file(path: Path) -> dict:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


class _IpcReader:
    """The record batches of one Arrow IPC file, memory-mapped: stream format (as `datasets` writes it) or
    file format."""

    def __init__(self, path: Path) -> None:
        import pyarrow as pa

        self._source = pa.memory_map(str(path))
        try:
            self._reader, self._is_stream = pa.ipc.open_stream(self._source), True
        except pa.ArrowInvalid:
            self._source.seek(0)
            self._reader, self._is_stream = pa.ipc.open_file(self._source), False
        self.schema = self._reader.schema

    def __iter__(self) -> Iterator:
        if self._is_stream:
            yield from self._reader
        else:
            for index in range(self._reader.num_record_batches):
                yield self._reader.get_batch(index)


def _open_ipc(path: Path) -> _IpcReader:
    return _IpcReader(path)


def flat_names(schema) -> list[str]:
    """A schema's column names, each field of a struct column as a dotted name of its own."""
    import pyarrow as pa

    def names(field, prefix: str) -> list[str]:
        if pa.types.is_struct(field.type):
            return [name for child in field.type for name in names(child, f"{prefix}{field.name}.")]
        return [prefix + field.name]

    return [name for field in schema for name in names(field, "")]


def _table_outcomes(path: Path, task: str, columns: ColumnMap, schema, batches, kind: str) -> Iterator[
        ItemOutcome | InputProblem]:
    import pyarrow as pa

    names = flat_names(schema)
    chosen, reasons = table_columns(names, task, columns)
    if chosen is None:
        yield from (InputProblem(str(path), 0, reason) for reason in reasons)
        return
    wanted = {column.split(".")[0] for column in chosen.named().values()} | set(PARAM_COLUMNS)
    read = [name for name in schema.names if name in wanted or chosen.is_standard() and not columns.named()]
    number = 0
    try:
        for batch in batches(read):
            for row in batch.to_pylist():
                number += 1
                yield _row(path, task, chosen, number, row)
    except (OSError, pa.ArrowException) as e:
        yield InputProblem(str(path), 0, f"cannot read as {kind}: {e}")
        return
    if number == 0:
        yield InputProblem(str(path), 0, "no items: the table has no rows")


def _row(path: Path, task: str, columns: ColumnMap, number: int, row: dict) -> ItemOutcome:
    outcome = ItemOutcome(str(path), number, "", f"row {number}", f"row-{number}")
    values = {name: value for name, value in row.items() if value is not None}
    outcome = row_outcome(values, columns, task, str(path), outcome)
    if outcome.problems:  # the row as the failed-item record keeps it; a valid row's input is its text
        outcome.raw = json.dumps(row, ensure_ascii=False, default=str)
    return outcome


def _listed(found: Iterable[ItemOutcome | InputProblem]) -> Found:
    outcomes, problems = [], []
    for each in found:
        (problems if isinstance(each, InputProblem) else outcomes).append(each)
    return ([] if problems else outcomes), problems
