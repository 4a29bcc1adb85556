"""Parquet results of a job: part files while the job runs, one merged file when it finishes.

Layout under results_dir:
    <job_id>/<writer>/part-00001.parquet, ...   written by one broker as its batches finish (one folder
                                                per broker process, so brokers sharing a folder never
                                                write the same name)
    <job_id>/part-00001.parquet, ...            written by an unnamed writer (one writer per job)
    <job_id>.parquet                            the final file, written by finalize()

Every file is written to a temporary name of its own process in the same folder, fsynced, renamed into
place and the folder fsynced, so a killed run never leaves an unreadable file under a final name. After
a successful finalize the parts are deleted (the final file holds every row); finalize reads an existing
final file as its oldest input, so running it again after more parts, or after a crash mid-cleanup,
loses nothing. Several brokers may write parts of one job; exactly one of them finalizes it
(storage/finalization.py), and what it writes comes from the store, so parts on other machines are
not needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from layerbus.storage.result_row import RESULT_FIELDS

# The result row's columns (storage.result_row), as a Parquet schema.
RESULT_SCHEMA = pa.schema([(name, pa.type_for_alias(kind)) for name, kind in RESULT_FIELDS])
_PART_NAME = re.compile(r"^part-(\d{5,})\.parquet$")
_TMP_SUFFIX = ".tmp"
# A temporary's name: the file's name, the writing process's id (two processes never share one), ".tmp".
_TMP_NAME = re.compile(r"^(?P<name>.+\.parquet)(?:\.(?P<pid>\d+))?\.tmp$")
# Characters a writer's name keeps in its folder name; others become "-".
_FOLDER_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class ResultWriter:
    """Writes one job's result parts and merges them into the final file."""

    def __init__(self, results_dir: Path, job_id: str, writer: str | None = None) -> None:
        # Folder that holds <job_id>.parquet and the <job_id>/ parts folder.
        self.results_dir = Path(results_dir)
        # The job whose results these are; stored in the final file's metadata.
        self.job_id = job_id
        # Folder of every part file of the job.
        self.job_parts_dir = self.results_dir / job_id
        # Folder of this writer's numbered part files: its own under job_parts_dir when it has a name
        # (a broker: "host:pid:token"), so several brokers sharing results_dir never collide.
        self.parts_dir = self.job_parts_dir / writer_folder(writer) if writer else self.job_parts_dir
        # The merged file finalize() writes.
        self.final_path = self.results_dir / f"{job_id}.parquet"
        # A restarted writer continues after the parts already on disk.
        self._next_part = max(_part_numbers(self.parts_dir), default=0) + 1
        _remove_temporaries(self.parts_dir, "part-")
        if writer is None:  # the job's one writer; a named one may share the job with a finalizing broker
            _remove_temporaries(self.results_dir, f"{job_id}.")

    def part_paths(self) -> list[Path]:
        """Every part file of the job on disk, this writer's and other writers': the unnamed writer's in the
        order they were written, then each named writer's in order, writers by their first part's age."""
        folders = sorted((path for path in _subfolders(self.job_parts_dir) if _part_numbers(path)),
                         key=lambda folder: (_first_part_mtime(folder), folder.name))
        return [folder / _part_name(n) for folder in [self.job_parts_dir, *folders]
                for n in sorted(_part_numbers(folder))]

    def write_part(self, rows: list[dict[str, Any]]) -> Path:
        """Write `rows` (dicts keyed by RESULT_SCHEMA columns; missing ones are null) as the next part."""
        if not rows:
            raise ValueError(f"write_part got no rows for job {self.job_id!r}: skip empty batches")
        table = _to_table(rows)
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        path = self.parts_dir / _part_name(self._next_part)
        write_atomically(table, path)
        self._next_part += 1
        return path

    def finalize(self, metadata: dict[str, str], store_rows: Iterable[dict[str, Any]] = ()) -> Path:
        """Merge the parts into <job_id>.parquet, one row per custom_id and sample_index, and delete the parts.

        Later parts win over earlier ones; `store_rows` (from JobStore.item_results: items failed at
        submit, cancelled items, or every finished item) win over all parts. `metadata` (model,
        settings JSON, ...) goes into the Parquet key-value metadata next to job_id.
        """
        if metadata.get("job_id", self.job_id) != self.job_id:
            raise ValueError(
                f"finalize metadata names job {metadata['job_id']!r} but this writer is for {self.job_id!r}"
            )
        parts = self.part_paths()
        sources = ([self.final_path] if self.final_path.exists() else []) + parts
        tables = [pq.read_table(path, schema=RESULT_SCHEMA) for path in sources]
        store_rows = list(store_rows)
        if store_rows:
            tables.append(_to_table(store_rows))
        merged = _last_row_per_sample(pa.concat_tables(tables) if tables else RESULT_SCHEMA.empty_table())
        # A re-run of finalize keeps what an earlier one recorded unless told otherwise.
        earlier = results_metadata(self.final_path) if self.final_path.exists() else {}
        file_metadata = {**earlier, **metadata, "job_id": self.job_id}
        self.results_dir.mkdir(parents=True, exist_ok=True)
        _remove_temporaries(self.results_dir, f"{self.job_id}.")  # a killed finalizer's
        write_atomically(merged.replace_schema_metadata(file_metadata), self.final_path)
        for path in parts:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.job_parts_dir, ignore_errors=True)
        return self.final_path

    def discard_parts(self) -> None:
        """Delete this writer's own part files: for a broker that did not finalize the job, once it is over
        (the final file, built from the store, holds its rows)."""
        if self.parts_dir != self.job_parts_dir:
            shutil.rmtree(self.parts_dir, ignore_errors=True)
            try:
                self.job_parts_dir.rmdir()  # the last broker out removes the job's folder
            except OSError:
                pass  # other brokers' parts are still there, or it is gone already


def writer_folder(writer: str) -> str:
    """The folder name of a named writer's parts: its name with unsafe characters replaced
    ("gpu-3:4242:9f3a" -> "gpu-3-4242-9f3a")."""
    folder = _FOLDER_UNSAFE.sub("-", writer).strip(".")
    if not folder:
        raise ValueError(f"writer name {writer!r} leaves no folder name: give one with letters or digits")
    return folder


def write_atomically(table: pa.Table, path: Path) -> None:
    """Write `table` to `path` so that `path` is either absent, its old content, or the whole new file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}{_TMP_SUFFIX}")
    with open(tmp, "wb") as handle:
        pq.write_table(table, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_folder(path.parent)


def read_results(path: Path) -> pa.Table:
    """A results file (final or part) as a table; its metadata via results_metadata()."""
    return pq.read_table(path)


def results_metadata(path: Path) -> dict[str, str]:
    """The key-value metadata of a results file: job_id, model, settings, ..."""
    raw = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in raw.items() if not k.startswith(b"ARROW:")}


def settings_metadata(job_id: str, model: str, settings: dict[str, Any]) -> dict[str, str]:
    """The metadata finalize() expects, from a job's model and settings."""
    return {"job_id": job_id, "model": model, "settings": json.dumps(settings, sort_keys=True)}


def _to_table(rows: list[dict[str, Any]]) -> pa.Table:
    known = set(RESULT_SCHEMA.names)
    for index, row in enumerate(rows):
        unknown = set(row) - known
        if unknown:
            raise ValueError(
                f"result row {index} has unknown column(s) {sorted(unknown)}; columns are {RESULT_SCHEMA.names}"
            )
        if not isinstance(row.get("custom_id"), str):
            raise ValueError(f"result row {index} needs a custom_id string, got {row.get('custom_id')!r}")
    return pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)


def _last_row_per_sample(table: pa.Table) -> pa.Table:
    """Keep the last row of each (custom_id, sample_index), ordered by seq then sample_index (rows without seq
    last, in arrival order). A row without sample_index (a part written before the column) is sample 0."""
    index = table.schema.get_field_index("sample_index")
    table = table.set_column(index, "sample_index", pc.fill_null(table.column("sample_index"), 0))
    order = pa.array(range(table.num_rows), pa.int64())
    table = table.append_column("_order", order)
    last = table.group_by(["custom_id", "sample_index"], use_threads=False).aggregate([("_order", "max")])["_order_max"]
    # Arrow puts nulls last by default, which is where rows without a seq belong.
    kept = table.take(last).sort_by([("seq", "ascending"), ("sample_index", "ascending"), ("_order", "ascending")])
    return kept.drop_columns(["_order"])


def _part_name(number: int) -> str:
    return f"part-{number:05d}.parquet"


def _part_numbers(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return [int(m.group(1)) for m in map(_PART_NAME.match, os.listdir(folder)) if m]


def _remove_temporaries(folder: Path, prefix: str) -> None:
    """Delete files a killed writer of this job left half-written; never renamed, nothing refers to them.

    A temporary of a process still running on this machine is another writer's work in progress
    (a broker's that shares the folder): it is left alone.
    """
    if not folder.is_dir():
        return
    for name in os.listdir(folder):
        match = _TMP_NAME.match(name)
        if not name.startswith(prefix) or match is None:
            continue
        pid = match.group("pid")
        if pid is None or (int(pid) != os.getpid() and not _process_alive(int(pid))):
            (folder / name).unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: checks without sending
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _subfolders(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return [folder / name for name in os.listdir(folder) if (folder / name).is_dir()]


def _first_part_mtime(folder: Path) -> float:
    try:
        return (folder / _part_name(min(_part_numbers(folder)))).stat().st_mtime
    except (OSError, ValueError):
        return float("inf")


def _fsync_folder(folder: Path) -> None:
    # The rename is only durable once the folder's entry is on disk.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
