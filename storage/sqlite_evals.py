"""JobStore.eval_history for a SQLite store on the standard library's sqlite3, read-only.

`layerbus eval history` is a glance at a suite's nightly numbers, answered in the time `layerbus status`
takes: importing SQLAlchemy alone costs about 240 ms, the two queries a few. Same queries as
eval_store.EvalTables.history (the runs newest first, then their metrics), same row conversions
(eval_records.metric_from_row, metric_order), so both paths agree (a contract test holds them to it).
None when this path cannot answer (not a plain SQLite file URL, a locked or foreign database, a store
older than the eval tables): the caller then opens the JobStore, whose messages and migrations apply.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing

from layerbus.storage.direct_db import direct_db, utc_from_db
from layerbus.storage.eval_records import DEFAULT_EVAL_LIMIT, EvalMetric, EvalRun, metric_from_row, metric_order

_RUN_COLUMNS = ("job_id", "suite", "model", "fingerprint_hash", "fingerprint_json", "settings_json", "created_at",
                "samples_path", "results_path", "finished_at")  # fmt: skip
# EvalRun's field order; created_at and finished_at are converted from text.
_RUNS = (f"SELECT {', '.join(_RUN_COLUMNS)} FROM eval_runs WHERE suite = ? AND finished_at IS NOT NULL "
         "ORDER BY created_at DESC, job_id DESC LIMIT ?")
_METRICS = "SELECT job_id, task, metric, filter, value, stderr, n FROM eval_metrics WHERE job_id IN ({marks})"


def read_eval_history(url: str, suite: str, metric: str | None = None,
                      limit: int = DEFAULT_EVAL_LIMIT) -> list[tuple[EvalRun, list[EvalMetric]]] | None:
    """What JobStore.eval_history(suite, metric, limit) returns, or None when this path cannot answer."""
    if limit < 1:
        raise ValueError(f"eval_history needs limit >= 1, got {limit=}")
    db = direct_db(url)
    if db is None or db.kind != "sqlite":  # this path reads SQLite only; PostgreSQL goes through the JobStore
        return None
    try:
        with closing(db.connect()) as conn:
            runs = [_run(row) for row in conn.execute(_RUNS, (suite, limit))]
            runs.reverse()
            per_run: dict[str, list[EvalMetric]] = {run.job_id: [] for run in runs}
            if runs:
                query = _METRICS.format(marks=", ".join("?" * len(runs)))
                params: list = [run.job_id for run in runs]
                if metric is not None:
                    query += " AND metric = ?"
                    params.append(metric)
                for job_id, *values in conn.execute(query, params):
                    per_run[job_id].append(metric_from_row(values))
    except sqlite3.Error:  # no eval tables yet, locked beyond the timeout, not a database: the full store decides
        return None
    return [(run, sorted(per_run[run.job_id], key=metric_order)) for run in runs]


def _run(row: tuple) -> EvalRun:
    fields = dict(zip(_RUN_COLUMNS, row))
    fields["created_at"] = utc_from_db(fields["created_at"])
    fields["finished_at"] = utc_from_db(fields["finished_at"])
    return EvalRun(**fields)
