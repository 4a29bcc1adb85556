"""`job_status`, `list_jobs`, `job_events`, `job_workers` and `stage_snapshots` through the store's driver
alone (sqlite3, libpq or psycopg, storage/direct_db.py), read-only.

`layerbus status` is what people poll while a job runs. Its query takes about 1 ms on SQLite and a few on
PostgreSQL; importing SQLAlchemy takes 130-240 ms. This module reads the same two things JobStore reads
(the job row and its item counters) and builds the JobStatus with the same pure function, so both paths
agree by construction (and a contract test holds them to it, on SQLite and PostgreSQL). Anything unusual
(a URL direct_db does not take, a missing file, a schema it does not know) returns None and the caller
uses JobStore; a store made before the job_events (or stage_snapshots) table existed has no events (or
stages) to show, which is not unusual. PostgreSQL connection failures raise StoreError, worded as the
full store words them (trying again through it would only wait out the same timeout twice).
"""

from __future__ import annotations

from contextlib import closing
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from layerbus.storage.direct_db import DirectDb, direct_db, sqlite_file, utc_from_db  # noqa: F401 (re-exported)
from layerbus.storage.events import DEFAULT_EVENT_LIMIT, events_oldest_first
from layerbus.storage.states import TIMESTAMP_COLUMNS
from layerbus.storage.status import StateAggregate, build_job_status
from layerbus.storage.status_records import WORKER_FIELDS, JobEvent, JobStatus, JobWorker, worker_from_row

if TYPE_CHECKING:
    from layerbus.storage.snapshot_records import StageSnapshot

_JOB_COLUMNS = ("id", "name", "task", "model", "status", "total_count", "results_path", "error", *TIMESTAMP_COLUMNS)
# The item counters (storage/item_counts.py): five rows per job, whatever its size. A store from before
# them has no such table: the driver raises, and JobStore.open fills them in.
_AGGREGATES = """
    SELECT job_id, status, items, ran, prompt_tokens, completion_tokens
    FROM item_counts WHERE job_id IN ({marks})"""
_EVENTS = "SELECT at, kind, message, duration_s FROM job_events WHERE job_id = ? ORDER BY id DESC LIMIT ?"
_WORKERS = f"SELECT {', '.join(WORKER_FIELDS)} FROM job_workers WHERE job_id = ? ORDER BY started_at, worker"


def read_job_status(url: str, job_id: str, now: datetime | None = None) -> JobStatus | None:
    statuses = _read(url, f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs WHERE id = ?", (job_id,), now)
    return statuses[0] if statuses else None


def read_recent_jobs(url: str, limit: int, now: datetime | None = None) -> list[JobStatus] | None:
    query = f"SELECT {', '.join(_JOB_COLUMNS)} FROM jobs ORDER BY created_at DESC, id DESC LIMIT ?"
    return _read(url, query, (limit,), now, allow_empty=True)


def read_job_events(url: str, job_id: str, limit: int = DEFAULT_EVENT_LIMIT) -> list[JobEvent] | None:
    """The job's last `limit` events, oldest first, as JobStore.job_events returns them; None when this
    path cannot answer. Call it for a job read_job_status found: an unknown job just has no events here."""
    db = direct_db(url)
    if db is None:
        return None
    try:
        with closing(db.connect()) as conn:
            if not db.has_table(conn, "job_events"):
                return []  # a store older than the table; JobStore.open adds it
            rows = conn.execute(db.sql(_EVENTS), (job_id, limit)).fetchall()
    except db.error:
        return None
    return events_oldest_first((utc_from_db(at), kind, message, duration) for at, kind, message, duration in rows)


def read_job_workers(url: str, job_id: str) -> list[JobWorker] | None:
    """The brokers that worked the job, as JobStore.job_workers returns them; None when this path cannot answer."""
    db = direct_db(url)
    if db is None:
        return None
    try:
        with closing(db.connect()) as conn:
            if not db.has_table(conn, "job_workers"):
                return []  # a store older than the table; a broker's JobStore.open adds it
            rows = [dict(zip(WORKER_FIELDS, row)) for row in conn.execute(db.sql(_WORKERS), (job_id,))]
    except db.error:
        return None
    for row in rows:
        row["started_at"], row["renewed_at"] = utc_from_db(row["started_at"]), utc_from_db(row["renewed_at"])
    return [worker_from_row(row) for row in rows]


def read_stage_snapshots(url: str, job_id: str) -> list[StageSnapshot] | None:
    """The job's stage snapshots as JobStore.stage_snapshots returns them; None when this path cannot answer."""
    # Here, not at the top: only `top` reads snapshots, and their records cost `status` 1-2 ms to import.
    from layerbus.storage.snapshot_records import SNAPSHOT_FIELDS, snapshot_from_row, snapshot_order

    db = direct_db(url)
    if db is None:
        return None
    try:
        with closing(db.connect()) as conn:
            if not db.has_table(conn, "stage_snapshots"):
                return []  # a store older than the table; a broker's JobStore.open adds it
            query = f"SELECT {', '.join(SNAPSHOT_FIELDS)} FROM stage_snapshots WHERE job_id = ?"
            rows = [dict(zip(SNAPSHOT_FIELDS, row)) for row in conn.execute(db.sql(query), (job_id,))]
    except db.error:
        return None
    for row in rows:
        row["updated_at"] = utc_from_db(row["updated_at"])
    return sorted((snapshot_from_row(row) for row in rows), key=snapshot_order)


def read_latest_job_ids(url: str, status: str | None = None, limit: int = 1) -> list[str] | None:
    """The ids of the newest `limit` jobs (of those in `status`, if given), newest first, as
    JobStore.latest_job_id orders them ([]: there are none); None when this path cannot answer."""
    db = direct_db(url)
    if db is None:
        return None
    where, params = ("WHERE status = ? ", (status, limit)) if status is not None else ("", (limit,))
    try:
        with closing(db.connect()) as conn:
            rows = conn.execute(db.sql(f"SELECT id FROM jobs {where}ORDER BY created_at DESC, id DESC LIMIT ?"),
                                params)
            return [row[0] for row in rows]
    except db.error:
        return None


def _read(url: str, query: str, params: tuple, now: datetime | None, allow_empty: bool = False):
    db = direct_db(url)
    if db is None:
        return None
    try:
        with closing(db.connect()) as conn:
            rows = [dict(zip(_JOB_COLUMNS, row)) for row in conn.execute(db.sql(query), params)]
            if not rows:
                return [] if allow_empty else None
            ids = [row["id"] for row in rows]
            aggregates: dict[str, list[StateAggregate]] = {}
            marks = ", ".join("?" * len(ids))
            for job_id, status, count, ran, prompt, completion in conn.execute(
                    db.sql(_AGGREGATES.format(marks=marks)), ids):
                aggregates.setdefault(job_id, []).append(
                    StateAggregate(status, int(count), int(ran), int(prompt), int(completion)))
    except db.error:  # locked beyond the timeout, another schema, not a database: the full store decides
        return None
    clock = now or datetime.now(timezone.utc)
    for row in rows:
        for column in TIMESTAMP_COLUMNS:
            row[column] = utc_from_db(row[column])
    return [build_job_status(row, aggregates.get(row["id"], []), clock) for row in rows]
