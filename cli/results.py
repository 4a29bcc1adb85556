"""`layerbus results`: where a job's Parquet file is, and optionally its first rows as a table."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from layerbus.cli.errors import EXIT_OK, RunFailed
from layerbus.cli.options import add_db, add_verbose, non_negative_int, open_store

if TYPE_CHECKING:
    from layerbus.storage import JobStatus

# Columns shown by --head, in order; output is last because it takes what width is left.
HEAD_COLUMNS = ("custom_id", "status", "finish_reason", "completion_tokens", "output")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("results", help="print the path of a job's Parquet results",
                                   description="Print the path of JOB's Parquet file (one row per custom_id); "
                                               "with --head N, also its first N rows.")
    parser.add_argument("job", metavar="JOB", help="job id (job_...)")
    parser.add_argument("--head", metavar="N", type=non_negative_int, default=0, help="show the first N rows")
    add_db(parser)
    add_verbose(parser)
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    status = _job_status(args.db, args.job)
    if status.results_path is None:
        done = status.completed + status.failed + status.cancelled
        raise RunFailed(f"job {status.job_id} is {status.status} ({done} of {status.total} items finished) and has "
                        f"no results file yet; wait with `layerbus status {status.job_id} --watch`")
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


def head_table(path: Path, rows: int) -> str:
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=list(HEAD_COLUMNS)).slice(0, rows).to_pylist()
    cells = [[_cell(row[c]) for c in HEAD_COLUMNS] for row in table]
    header = [c.upper() for c in HEAD_COLUMNS]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(HEAD_COLUMNS) - 1)]
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
