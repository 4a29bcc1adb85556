"""`layerbus eval history SUITE`: the suite's finished runs oldest first, one line per run, its metrics as columns
(one block per task when that is wider than the terminal), with the change from the run before and a trend.

As light as `layerbus status`: a SQLite store is read with the standard library's sqlite3
(storage/sqlite_evals.py) and nothing heavier than json is imported; other stores go through JobStore."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from layerbus.cli.errors import EXIT_OK
from layerbus.cli.options import add_db, command_parser, open_store, positive_int

if TYPE_CHECKING:
    from layerbus.evals.history_table import History, HistoryLine
    from layerbus.storage import EvalMetric, EvalRun

DEFAULT_LIMIT = 30  # a month of nightly runs
SHORT_HASH = 8
# Width assumed when stdout is no terminal (a pipe, a CI log).
FALLBACK_WIDTH = 120


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "history", main, help="a suite's metrics run after run",
                        description="Each finished run of SUITE, oldest first: date (UTC), job id, "
                                    "fingerprint, and per task and metric the value ± its standard error, "
                                    "with the change from the run before (* beyond 1.96 combined standard "
                                    "errors) and a trend line. `layerbus eval compare` tests two runs "
                                    "document by document.") as parser:
        parser.add_argument("suite", metavar="SUITE", help="suite name (as in `layerbus eval run --suite NAME`)")
        parser.add_argument("--metric", metavar="M", default=None, help="only this metric (e.g. acc, bits_per_byte)")
        parser.add_argument("--limit", metavar="N", type=positive_int, default=DEFAULT_LIMIT,
                            help=f"the last N runs (default: {DEFAULT_LIMIT})")
        parser.add_argument("--json", action="store_true", help="print the runs and their metrics as JSON")
        add_db(parser)


def main(args: argparse.Namespace) -> int:
    history, url = _read(args)
    if args.json:
        print(json.dumps([_run_json(run, metrics) for run, metrics in history], indent=2))
        return EXIT_OK
    if not history:
        print(f"no finished runs of suite {args.suite!r} in {url} yet: `layerbus eval run --suite {args.suite}` "
              f"records one; run it every night and this shows the trend")
        return EXIT_OK
    from layerbus.evals.history_table import history_table

    table = history_table(history)
    if not table.columns:
        print(f"no metric {args.metric!r} in the {len(history)} run(s) of suite {args.suite!r}: drop --metric to see "
              "every metric")
        return EXIT_OK
    print(history_text(args.suite, table, shutil.get_terminal_size((FALLBACK_WIDTH, 24)).columns))
    return EXIT_OK


def _read(args: argparse.Namespace) -> tuple[list[tuple[EvalRun, list[EvalMetric]]], str]:
    """The history and the store's URL for messages; from sqlite3 when the store is a SQLite file."""
    from layerbus.storage.direct_db import sqlite_file
    from layerbus.storage.locations import default_db_url
    from layerbus.storage.sqlite_evals import read_eval_history

    url = args.db or default_db_url()
    found = read_eval_history(url, args.suite, args.metric, args.limit)
    if found is not None:
        return found, url
    path = sqlite_file(url)
    if path is not None and not path.exists():
        return [], url  # no store file, so no runs: say so without creating one
    with open_store(url) as store:
        return store.eval_history(args.suite, args.metric, args.limit), store.url


def history_text(suite: str, table: History, width: int) -> str:
    """The wide table when it fits in `width`, else one block per task."""
    count = len(table.lines)
    lines = [f"suite {suite}: {count} run{'s' if count != 1 else ''}, oldest first",
             "value ± standard error; ↑ ↓ = change from the run before, * beyond 1.96 combined standard errors",
             ""]
    wide = _block(table, range(len(table.columns)), with_task=True)
    if max(len(line) for line in wide) <= width:
        lines += wide
    else:
        tasks = list(dict.fromkeys(c.task for c in table.columns))
        for task in tasks:
            indices = [i for i, c in enumerate(table.columns) if c.task == task]
            lines += [task, *_block(table, indices, with_task=False), ""]
        lines.pop()
    lines += _footer(table)
    return "\n".join(lines)


def _block(table: History, indices: Sequence[int], with_task: bool) -> list[str]:
    columns = [table.columns[i] for i in indices]
    header = ["date (UTC)", "job", "fingerprint", *(c.label for c in columns)]
    rows = [[_clock(line), line.run.job_id, _fingerprint(line), *(_cell_text(line.cells[i]) for i in indices)]
            for line in table.lines]
    trend = ["trend", "", "", *(table.trend(i) for i in indices)]
    grid = [header, *rows, trend]
    widths = [max(len(row[k]) for row in grid) for k in range(len(header))]
    if with_task:  # a task's name over its first column; wider names widen that column
        tasks = ["", "", "", *(c.task if k == 0 or columns[k - 1].task != c.task else ""
                               for k, c in enumerate(columns))]
        widths = [max(w, len(t)) for w, t in zip(widths, tasks)]
        grid.insert(0, tasks)
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in grid]


def _cell_text(cell) -> str:
    if cell is None:
        return "-"
    stderr = f" ± {cell.stderr:.4f}" if cell.stderr is not None else ""
    mark = f" {cell.change}{'*' if cell.beyond_noise else ''}" if cell.change else ""
    return f"{cell.value:.4f}{stderr}{mark}"


def _fingerprint(line: HistoryLine) -> str:
    return line.run.fingerprint_hash[:SHORT_HASH] + (" ≠" if line.fingerprint_changed else "")


def _footer(table: History) -> list[str]:
    """Where the fingerprint changed and in what, and the compare command for the last two runs."""
    lines = []
    for before, line in zip(table.lines, table.lines[1:]):
        if line.fingerprint_changed:
            from layerbus.evals.fingerprint_diff import fingerprint_changes, summary  # only when needed: it costs ms

            changes = fingerprint_changes(before.run.fingerprint_json, line.run.fingerprint_json)
            lines.append(f"  {_clock(line)}  {line.run.job_id}: {summary(changes)}")
    out = ["", "≠ fingerprint changed:", *lines] if lines else []
    if len(table.lines) >= 2:
        base, cand = table.lines[-2].run.job_id, table.lines[-1].run.job_id
        out += ["", f"paired test of the last two runs: layerbus eval compare {base} {cand}"]
    return out


def _clock(line: HistoryLine) -> str:
    return line.run.created_at.strftime("%Y-%m-%d %H:%M")


def _run_json(run: EvalRun, metrics: Sequence[EvalMetric]) -> dict[str, Any]:
    import math

    return {
        "job_id": run.job_id, "suite": run.suite, "model": run.model, "created_at": run.created_at.isoformat(),
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        "fingerprint_hash": run.fingerprint_hash,
        "metrics": [{"task": m.task, "metric": m.metric, "filter": m.filter,
                     "value": None if math.isnan(m.value) else m.value, "stderr": m.stderr, "n": m.n}
                    for m in metrics],
    }  # fmt: skip
