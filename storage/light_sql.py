"""The statements behind the light commands (`status`, `top`, `cancel`, `eval history`), written once.

JobStore runs them through SQLAlchemy's connection (storage/store_db.py), the driver-only path through
sqlite3, libpq or psycopg (storage/direct_db.py), and both build their records with the conversions here,
so the two answer alike by construction; the store's contract suite reads through both and compares.
Standard library only: the light commands import this without SQLAlchemy.

Statements are written with `?` marks. A `Run` runs one on the caller's connection, in the caller's
transaction and with its driver's placeholders, and returns the driver's result: iterable rows of plain
driver values, fetchone, fetchall and rowcount. Timestamps come back as the driver gives them (text on
SQLite, datetimes on PostgreSQL) and are read with utc_from_db.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NamedTuple

from layerbus.storage.clock import utc_now
from layerbus.storage.errors import StoreError
from layerbus.storage.events import events_oldest_first
from layerbus.storage.states import CANCELLABLE_JOB_STATES, TIMESTAMP_COLUMNS
from layerbus.storage.status import StateAggregate, build_job_status
from layerbus.storage.status_records import (WORKER_FIELDS, DocumentProgress, JobEvent, JobStatus, JobWorker,
                                             worker_from_row)

if TYPE_CHECKING:
    from layerbus.storage.eval_records import EvalMetric, EvalRun
    from layerbus.storage.snapshot_records import StageSnapshot

# Runs one statement (`?` marks) with its parameters on the caller's connection; returns the driver's result.
Run = Callable[[str, Sequence[object]], Any]

# The jobs columns a JobStatus is built from.
JOB_COLUMNS = ("id", "name", "task", "model", "status", "total_count", "results_path", "error", *TIMESTAMP_COLUMNS)
_JOB = f"SELECT {', '.join(JOB_COLUMNS)} FROM jobs WHERE id = ?"
_RECENT_JOBS = f"SELECT {', '.join(JOB_COLUMNS)} FROM jobs ORDER BY created_at DESC, id DESC LIMIT ?"
# The item counters (storage/item_counts.py): five rows per job, whatever its size.
_COUNTERS = ("SELECT job_id, status, items, ran, prompt_tokens, completion_tokens FROM item_counts "
             "WHERE job_id IN ({marks})")
_LATEST_IDS = "SELECT id FROM jobs {where}ORDER BY created_at DESC, id DESC LIMIT ?"
_EVENTS = "SELECT at, kind, message, duration_s FROM job_events WHERE job_id = ? ORDER BY id DESC LIMIT ?"
_WORKERS = f"SELECT {', '.join(WORKER_FIELDS)} FROM job_workers WHERE job_id = ? ORDER BY started_at, worker"
_SNAPSHOTS = "SELECT {columns} FROM stage_snapshots WHERE job_id = ?"
# The cancel: the job's state, its counters (locked in state order on PostgreSQL), then the job row.
_JOB_STATUS = "SELECT status FROM jobs WHERE id = ?"
# A job's long documents (storage/document_parts.py): its parts, then its split documents' own items, by level.
_PARTS = ("SELECT level, status, count(*) FROM items WHERE job_id = ? AND parent_id IS NOT NULL "
          "GROUP BY level, status")
_SPLIT_DOCUMENTS = ("SELECT level, status, combine, count(*) FROM items WHERE job_id = ? AND parent_id IS NULL "
                    "AND combine IS NOT NULL GROUP BY level, status, combine")
_JOB_COUNTERS = "SELECT status, items FROM item_counts WHERE job_id = ? ORDER BY status"
_MARK_CANCELLED = "UPDATE jobs SET status = ?, cancelling_at = ?{cancelled} WHERE id = ? AND status = ?"
# The eval_runs columns in EvalRun's field order, and the eval_metrics columns metric_from_row takes.
EVAL_RUN_COLUMNS = ("job_id", "suite", "model", "fingerprint_hash", "fingerprint_json", "settings_json",
                    "created_at", "samples_path", "results_path", "finished_at")  # fmt: skip
EVAL_METRIC_COLUMNS = ("task", "metric", "filter", "value", "stderr", "n")
_FINISHED_RUNS = (f"SELECT {', '.join(EVAL_RUN_COLUMNS)} FROM eval_runs WHERE suite = ? AND finished_at IS NOT NULL "
                  "ORDER BY created_at DESC, job_id DESC LIMIT ?")
_METRICS = f"SELECT job_id, {', '.join(EVAL_METRIC_COLUMNS)} FROM eval_metrics WHERE job_id IN ({{marks}})"


class Cancel(NamedTuple):
    """What cancel_job found and did."""

    # The job's state before the cancel; None when there is no such job.
    found: str | None
    # Its state after the cancel (cancelling or cancelled); None when it was not cancelled: a job in `found`
    # cannot be, or the job has no item counters yet (JobStore.open counts them).
    status: str | None


def job_status(run: Run, job_id: str, now: datetime | None) -> JobStatus | None:
    """State, counts, throughput and ETA of one job as seen at `now` (two queries, neither reading items);
    None when there is no such job."""
    statuses = _statuses(run, _JOB, (job_id,), now)
    return statuses[0] if statuses else None


def document_progress(run: Run, job_id: str) -> DocumentProgress | None:
    """How far the job's long documents are; None when it split none. Reads the parts' rows (through the
    items' (job_id, parent_id) index): nothing for a job without long documents."""
    parts = list(run(_PARTS, (job_id,)))
    if not parts:
        return None
    documents = list(run(_SPLIT_DOCUMENTS, (job_id,)))
    unfinished = ("queued", "in_progress", "waiting")
    levels = {level for level, status, _ in parts if level and status in unfinished}
    levels |= {level for level, status, combine, _ in documents if status in unfinished and combine == "reduce"}
    return DocumentProgress(
        split=sum(count for *_, count in documents), parts=sum(count for *_, count in parts),
        parts_done=sum(count for _, status, count in parts if status not in unfinished),
        documents_done=sum(count for _, status, _, count in documents if status not in unfinished),
        levels_remaining=len(levels))


def recent_jobs(run: Run, limit: int, now: datetime | None) -> list[JobStatus]:
    """The `limit` most recently created jobs (created_at, then id), newest first."""
    return _statuses(run, _RECENT_JOBS, (limit,), now)


def latest_job_ids(run: Run, status: str | None, limit: int) -> list[str]:
    """The ids of the newest `limit` jobs (created_at, then id), of those in `status` if given, newest first."""
    where, params = ("WHERE status = ? ", (status, limit)) if status is not None else ("", (limit,))
    return [row[0] for row in run(_LATEST_IDS.format(where=where), params)]


def job_events(run: Run, job_id: str, limit: int) -> list[JobEvent]:
    """The job's last `limit` events, oldest first ([] for a job that has none, or that does not exist)."""
    check_limit("job_events", limit)
    rows = run(_EVENTS, (job_id, limit))
    return events_oldest_first((utc_from_db(at), kind, message, duration) for at, kind, message, duration in rows)


def job_workers(run: Run, job_id: str) -> list[JobWorker]:
    """The brokers that worked the job (storage/job_workers.py), in the order they started."""
    rows = [dict(zip(WORKER_FIELDS, row)) for row in run(_WORKERS, (job_id,))]
    for row in rows:
        row["started_at"], row["renewed_at"] = utc_from_db(row["started_at"]), utc_from_db(row["renewed_at"])
    return [worker_from_row(row) for row in rows]


def stage_snapshots(run: Run, job_id: str) -> list[StageSnapshot]:
    """Every broker's latest view of the job's stages, by broker, then in chain order (snapshot_order)."""
    # Here, not at the top: only `top` reads snapshots, and their records cost `status` 1-2 ms to import.
    from layerbus.storage.snapshot_records import SNAPSHOT_FIELDS, snapshot_from_row, snapshot_order

    query = _SNAPSHOTS.format(columns=", ".join(SNAPSHOT_FIELDS))
    rows = [dict(zip(SNAPSHOT_FIELDS, row)) for row in run(query, (job_id,))]
    for row in rows:
        row["updated_at"] = utc_from_db(row["updated_at"])
    return sorted((snapshot_from_row(row) for row in rows), key=snapshot_order)


def cancel_job(run: Run, kind: str, job_id: str, now: datetime | None) -> Cancel:
    """Cancel a job's queued items, in the caller's write transaction on a `kind` database (sqlite or postgresql).

    The job becomes cancelled at once when nothing is in flight, otherwise cancelling until its in-flight
    items finish or are requeued; cancelling twice is harmless. The queued items' rows and their counter
    stay as they are: the job's cancelling_at marks them cancelled for claims, counts and results alike
    (storage/item_counts.py), so a cancel is these three statements whatever the job's size. Locking the
    counters waits out concurrent completions and requeues, so the in-flight count is final.
    """
    stamp = stored_timestamp(kind, utc_now(now))
    row = run(_JOB_STATUS, (job_id,)).fetchone()
    if row is None:
        return Cancel(None, None)
    found = row[0]
    if found in ("cancelling", "cancelled"):
        return Cancel(found, found)
    if found not in CANCELLABLE_JOB_STATES:
        return Cancel(found, None)
    locking = " FOR UPDATE" if kind == "postgresql" else ""
    counts = dict(run(_JOB_COUNTERS + locking, (job_id,)).fetchall())
    if "in_progress" not in counts:
        return Cancel(found, None)
    target = "cancelling" if counts["in_progress"] else "cancelled"
    cancelled = ", cancelled_at = ?" if target == "cancelled" else ""
    params = (target, stamp, *((stamp,) if cancelled else ()), job_id, found)
    if run(_MARK_CANCELLED.format(cancelled=cancelled), params).rowcount != 1:
        raise StoreError(f"job {job_id!r} changed state while being cancelled; run the cancel again")
    return Cancel(found, target)


def eval_history(run: Run, suite: str, metric: str | None, limit: int) -> list[tuple[EvalRun, list[EvalMetric]]]:
    """The suite's last `limit` finished runs, oldest first, each with its metrics (only `metric`'s, if given).

    Two queries: the runs, then their metrics."""
    from layerbus.storage.eval_records import metric_from_row, metric_order

    check_limit("eval_history", limit)
    runs = [eval_run_from_row(row) for row in run(_FINISHED_RUNS, (suite, limit))]
    runs.reverse()
    per_run: dict[str, list[EvalMetric]] = {r.job_id: [] for r in runs}
    if runs:
        query = _METRICS.format(marks=", ".join("?" * len(runs)))
        params: list[object] = [r.job_id for r in runs]
        if metric is not None:
            query += " AND metric = ?"
            params.append(metric)
        for job_id, *values in run(query, params):
            per_run[job_id].append(metric_from_row(values))
    return [(r, sorted(per_run[r.job_id], key=metric_order)) for r in runs]


def eval_run_from_row(row: Sequence[Any]) -> EvalRun:
    """An EvalRun from an eval_runs row read in EVAL_RUN_COLUMNS' order."""
    from layerbus.storage.eval_records import EvalRun

    fields = dict(zip(EVAL_RUN_COLUMNS, row))
    fields["created_at"] = utc_from_db(fields["created_at"])
    fields["finished_at"] = utc_from_db(fields["finished_at"])
    return EvalRun(**fields)


def check_limit(method: str, limit: int) -> None:
    if limit < 1:
        raise ValueError(f"{method} needs limit >= 1, got {limit=}")


def utc_from_db(value: str | datetime | None) -> datetime | None:
    """An aware UTC datetime from a timestamp column as the driver returns it: text on SQLite
    ("YYYY-MM-DD HH:MM:SS[.ffffff]", naive UTC, as storage.schema.UtcDateTime stores it), a datetime on
    PostgreSQL."""
    if value is None:
        return None
    parsed = datetime.fromisoformat(value) if isinstance(value, str) else value
    return parsed.replace(tzinfo=timezone.utc) if parsed.tzinfo is None else parsed.astimezone(timezone.utc)


def stored_timestamp(kind: str, value: datetime) -> datetime | str:
    """An aware datetime as a timestamp column of a `kind` database stores it: naive UTC text on SQLite (as
    storage.schema's UtcDateTime writes it through SQLAlchemy, microseconds always shown), timestamptz on
    PostgreSQL."""
    value = value.astimezone(timezone.utc)
    if kind == "sqlite":
        return value.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")
    return value


def _statuses(run: Run, query: str, params: Sequence[object], now: datetime | None) -> list[JobStatus]:
    """The JobStatus of each job row `query` selects (JOB_COLUMNS), from the rows and their item counters."""
    rows = [dict(zip(JOB_COLUMNS, row)) for row in run(query, params)]
    if not rows:
        return []
    ids = [row["id"] for row in rows]
    aggregates: dict[str, list[StateAggregate]] = {}
    for job_id, status, *totals in run(_COUNTERS.format(marks=", ".join("?" * len(ids))), ids):
        aggregates.setdefault(job_id, []).append(StateAggregate(status, *(int(total) for total in totals)))
    clock = utc_now(now)
    for row in rows:
        for column in TIMESTAMP_COLUMNS:
            row[column] = utc_from_db(row[column])
    return [build_job_status(row, aggregates.get(row["id"], []), clock) for row in rows]
