"""`layerbus results`: where a job's Parquet file is, and optionally its first rows as a table; with
--format openai, the job's OpenAI Batch output and error files (JSON Lines) read from the store."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

from layerbus.cli.errors import EXIT_OK, RunFailed, UsageError
from layerbus.cli.options import add_db, command_parser, non_negative_int, open_store

if TYPE_CHECKING:
    from layerbus.storage import JobStatus

# Columns shown by --head, in order; output is last because it takes what width is left.
HEAD_COLUMNS = ("custom_id", "status", "finish_reason", "completion_tokens", "output")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "results", main, help="print the path of a job's Parquet results",
                        description="Print the path of JOB's Parquet file (one row per custom_id); "
                                    "with --head N, also its first N rows. With --format openai, "
                                    "write the job's OpenAI Batch output and error JSONL instead.") as parser:
        parser.add_argument("job", metavar="JOB", help="job id (job_...)")
        parser.add_argument("--head", metavar="N", type=non_negative_int, default=0, help="show the first N rows")
        parser.add_argument("--format", choices=("parquet", "openai"), default="parquet",
                            help="parquet (default): print the Parquet file's path; openai: write the OpenAI Batch "
                                 "output JSONL (completed items) and error JSONL (failed and cancelled items)")
        parser.add_argument("--output", metavar="FILE", default="-",
                            help="with --format openai: where the output JSONL goes (default: standard output)")
        parser.add_argument("--errors", metavar="FILE", default=None,
                            help="with --format openai: where the error JSONL goes (default: not written, only "
                                 "counted)")
        add_db(parser)


def main(args: argparse.Namespace) -> int:
    status = _job_status(args.db, args.job)
    if status.results_path is None:
        done = status.completed + status.failed + status.cancelled
        raise RunFailed(f"job {status.job_id} is {status.status} ({done} of {status.total} items finished) and has "
                        f"no results file yet; wait with `layerbus status {status.job_id} --watch`")
    if args.format == "openai":
        return write_openai(args, status)
    if args.output != "-" or args.errors is not None:
        raise UsageError("--output and --errors go with --format openai; the Parquet file is at the path printed "
                         "without them")
    path = Path(status.results_path)
    if not path.is_file():
        raise RunFailed(f"job {status.job_id}'s results file {path} is gone (moved or deleted?)")
    print(path)
    if args.head:
        print(head_table(path, args.head))
    return EXIT_OK


def _job_status(url: str | None, job_id: str) -> JobStatus:
    """The job's status through the store's driver alone when it can answer (no SQLAlchemy: most of this
    command's time), else from the full store, which also words the errors."""
    from layerbus.storage.direct_status import read_job_status
    from layerbus.storage.locations import default_db_url

    status = read_job_status(url or default_db_url(), job_id)
    if status is not None:
        return status
    with open_store(url) as store:
        return store.job_status(job_id)


def write_openai(args: argparse.Namespace, status: JobStatus) -> int:
    """Stream the job's items from the store (the record of what is done) into the OpenAI files, in
    submission order. Each file is written under a temporary name and renamed once whole."""
    from layerbus.jobs.openai_output import OutputJob, join_by_seq, write_openai_files

    if args.head:
        raise UsageError("--head shows Parquet rows; with --format openai, read the output file (or `| head`)")
    if args.errors is not None and args.errors == args.output:
        raise UsageError(f"--output and --errors both name {args.errors}: give the error lines a file of their own")
    finished = next((status.timestamps.get(f"{state}_at") for state in ("completed", "failed", "cancelled")
                     if status.timestamps.get(f"{state}_at") is not None), status.timestamps.get("created_at"))
    # The model's name, as OpenAI's bodies carry it: a job records its model's directory, a local path.
    model = PurePath(status.model).name or status.model
    job = OutputJob(job_id=status.job_id, model=model, created=int(finished.timestamp()) if finished else 0)
    with open_store(args.db) as store, _WholeFile(args.output) as output, _WholeFile(args.errors) as errors:
        items = join_by_seq(store.item_results(status.job_id), store.job_items(status.job_id))
        counts = write_openai_files(job, items, output, errors)
    where = "" if args.errors else " (not written: give --errors FILE)"
    print(f"layerbus: {counts.output} completed item(s) to {_shown(args.output)}, {counts.errors} failed or "
          f"cancelled item(s) to {_shown(args.errors)}{where}", file=sys.stderr)
    return EXIT_OK


class _WholeFile:
    """A text file written whole or not at all (FILE.tmp renamed into place on success); "-" is standard
    output, None is no file."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._handle = None

    def __enter__(self):  # type: ignore[no-untyped-def]
        if self.name is None:
            return None
        if self.name == "-":
            return sys.stdout
        self._tmp = f"{self.name}.tmp"
        try:
            self._handle = open(self._tmp, "w", encoding="utf-8")
        except OSError as error:
            raise RunFailed(f"cannot write {self.name}: {error.strerror}; choose another path") from None
        return self._handle

    def __exit__(self, kind, value, traceback) -> None:  # type: ignore[no-untyped-def]
        if self._handle is None:
            return
        self._handle.close()
        if kind is None:
            os.replace(self._tmp, self.name)
        else:
            os.unlink(self._tmp)


def _shown(name: str | None) -> str:
    return "standard output" if name == "-" else "nowhere" if name is None else name


def head_table(path: Path, rows: int) -> str:
    import pyarrow.parquet as pq

    columns = list(HEAD_COLUMNS)
    if "sample_index" in pq.read_schema(path).names:
        columns.insert(1, "sample_index")  # shown only where an item has several samples (n > 1): see below
    table = pq.read_table(path, columns=columns).slice(0, rows).to_pylist()
    if "sample_index" in columns and not any(row["sample_index"] for row in table):
        columns.remove("sample_index")  # every row is sample 0: the column would only take width
    cells = [[_cell(row[c]) for c in columns] for row in table]
    header = ["SAMPLE" if c == "sample_index" else c.upper() for c in columns]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(columns) - 1)]
    room = max(20, shutil.get_terminal_size((120, 20)).columns - sum(widths) - 2 * len(widths))
    lines = []
    for row in [header, *cells]:
        fixed = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        output = row[-1] if len(row[-1]) <= room else row[-1][: room - 1] + "…"
        lines.append(f"{fixed}  {output}".rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return " ".join(str(value).split())  # one line per row: newlines and runs of spaces become one space
