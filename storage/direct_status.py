"""`job_status`, `list_jobs`, `job_events`, `job_workers`, `stage_snapshots` and `latest_job_id` through the
store's driver alone (sqlite3, libpq or psycopg, storage/direct_db.py), read-only.

`layerbus status` is what people poll while a job runs. Its query takes about 1 ms on SQLite and a few on
PostgreSQL; importing SQLAlchemy takes 130-240 ms. This module runs the statements JobStore runs and builds
the same records (storage/light_sql.py holds both), and the store's contract suite reads through both paths
and compares. Anything unusual (a URL direct_db does not take, a missing file, a schema it does not know)
returns None and the caller uses JobStore; a store made before the job_events (or job_workers,
stage_snapshots) table existed has no events (or workers, stages) to show, which is not unusual.
PostgreSQL connection failures raise StoreError, worded as the full store words them (trying again
through it would only wait out the same timeout twice).
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from layerbus.storage import light_sql
from layerbus.storage.direct_db import DirectDb, direct_db, read_directly, sqlite_file  # noqa: F401 (re-exported)
from layerbus.storage.events import DEFAULT_EVENT_LIMIT
from layerbus.storage.light_sql import utc_from_db  # noqa: F401 (re-exported)
from layerbus.storage.status_records import DocumentProgress, JobEvent, JobStatus, JobWorker

if TYPE_CHECKING:
    from layerbus.storage.snapshot_records import StageSnapshot


def read_job_status(url: str, job_id: str, now: datetime | None = None) -> JobStatus | None:
    """JobStore.job_status's answer; None for an unknown job (the full store words the error) and when this
    path cannot answer."""
    return read_directly(url, lambda run: light_sql.job_status(run, job_id, now))


def read_document_progress(url: str, job_id: str) -> DocumentProgress | None | bool:
    """JobStore.document_progress's answer; False when this path cannot answer."""
    answer = read_directly(url, lambda run: (light_sql.document_progress(run, job_id),))
    return False if answer is None else answer[0]


def read_recent_jobs(url: str, limit: int, now: datetime | None = None) -> list[JobStatus] | None:
    """JobStore.list_jobs's answer; None when this path cannot answer."""
    return read_directly(url, lambda run: light_sql.recent_jobs(run, limit, now))


def read_job_events(url: str, job_id: str, limit: int = DEFAULT_EVENT_LIMIT) -> list[JobEvent] | None:
    """The job's last `limit` events, oldest first, as JobStore.job_events returns them; None when this
    path cannot answer. Call it for a job read_job_status found: an unknown job just has no events here."""
    return read_directly(url, lambda run: light_sql.job_events(run, job_id, limit), table="job_events")


def read_job_workers(url: str, job_id: str) -> list[JobWorker] | None:
    """The brokers that worked the job, as JobStore.job_workers returns them; None when this path cannot answer."""
    return read_directly(url, lambda run: light_sql.job_workers(run, job_id), table="job_workers")


def read_stage_snapshots(url: str, job_id: str) -> list[StageSnapshot] | None:
    """The job's stage snapshots as JobStore.stage_snapshots returns them; None when this path cannot answer."""
    return read_directly(url, lambda run: light_sql.stage_snapshots(run, job_id), table="stage_snapshots")


def read_latest_job_ids(url: str, status: str | None = None, limit: int = 1) -> list[str] | None:
    """The ids of the newest `limit` jobs (of those in `status`, if given), newest first, as
    JobStore.latest_job_id orders them ([]: there are none); None when this path cannot answer."""
    return read_directly(url, lambda run: light_sql.latest_job_ids(run, status, limit))
