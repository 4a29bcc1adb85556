"""JobStore.eval_history for a SQLite store on the standard library's sqlite3, read-only.

`layerbus eval history` is a glance at a suite's nightly numbers, answered in the time `layerbus status`
takes: importing SQLAlchemy alone costs about 240 ms, the two queries a few. It runs the queries JobStore
runs and builds the same records (storage/light_sql.py holds both). None when this path cannot answer (not
a plain SQLite file URL, a locked or foreign database, a store older than the eval tables): the caller then
opens the JobStore, whose messages and migrations apply.
"""

from __future__ import annotations

from layerbus.storage import light_sql
from layerbus.storage.direct_db import read_directly, sqlite_file
from layerbus.storage.eval_records import DEFAULT_EVAL_LIMIT, EvalMetric, EvalRun


def read_eval_history(url: str, suite: str, metric: str | None = None,
                      limit: int = DEFAULT_EVAL_LIMIT) -> list[tuple[EvalRun, list[EvalMetric]]] | None:
    """What JobStore.eval_history(suite, metric, limit) returns, or None when this path cannot answer."""
    light_sql.check_limit("eval_history", limit)
    if sqlite_file(url) is None:  # this path reads SQLite only; PostgreSQL goes through the JobStore
        return None
    return read_directly(url, lambda run: light_sql.eval_history(run, suite, metric, limit))
