"""A job's way through its states (storage/states.py): moves callers ask for, the cancel, and the last step
of a cancel, taken once nothing of the job is in flight any more."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, select, update

from layerbus.storage import light_sql
from layerbus.storage.clock import utc_now
from layerbus.storage.errors import StoreError
from layerbus.storage.schema import item_counts as counts_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.states import CANCELLABLE_JOB_STATES, check_job_transition, timestamp_column
from layerbus.storage.store_db import StoreDb

COUNT = counts_table.c
JOB = jobs_table.c


class JobLifecycle:
    """JobStore's set_job_status, cancel_job and set_results_path."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    def set_job_status(self, job_id: str, status: str, error: str | None, now: datetime | None) -> None:
        """Move a job to `status`, stamping `<status>_at`; StoreError if the lifecycle forbids the move."""
        now = utc_now(now)
        with self._db.write() as conn:
            query = select(JOB.status).where(JOB.id == job_id)
            current = conn.execute(self._db.locking(query)).scalar_one_or_none()
            if current is None:
                raise self._db.no_job(job_id)
            check_job_transition(job_id, current, status)
            values: dict[str, Any] = {"status": status, timestamp_column(status): now}
            if error is not None:
                values["error"] = error
            conn.execute(update(jobs_table).where(JOB.id == job_id).values(**values))

    def cancel_job(self, job_id: str, now: datetime | None) -> str:
        """Cancel a job's queued items and return the job's new status (light_sql.cancel_job: the statements
        `layerbus cancel` runs without SQLAlchemy). Finished outputs stay."""
        with self._db.write() as conn:
            found, status = light_sql.cancel_job(self._db.statements(conn), self._db.kind, job_id, now)
        if found is None:
            raise self._db.no_job(job_id)
        if status is None and found not in CANCELLABLE_JOB_STATES:
            raise StoreError(
                f"job {job_id!r} is {found}: only {', '.join(CANCELLABLE_JOB_STATES)} jobs can be cancelled"
            )
        if status is None:  # JobStore.open counts every job's items; a store it opened has them
            raise StoreError(f"job {job_id!r} has no item counters in {self._db.url}; open the store again")
        return status

    def set_results_path(self, job_id: str, path: str | Path) -> None:
        with self._db.write() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            conn.execute(update(jobs_table).where(JOB.id == job_id).values(results_path=str(path)))


def settle_cancelling(db: StoreDb, conn: Connection, job_ids: Iterable[str], now: datetime) -> None:
    """Move cancelling jobs among `job_ids` to cancelled once none of their items is in flight.

    Call it after applying this transaction's counter changes: it reads the in-flight counter.
    """
    query = select(JOB.id).where(JOB.id.in_(list(job_ids)), JOB.status == "cancelling")
    for job_id in conn.execute(db.locking(query)).scalars().all():
        in_flight = conn.execute(
            select(COUNT["items"]).where(COUNT.job_id == job_id, COUNT.status == "in_progress")
        ).scalar_one()
        if in_flight == 0:
            conn.execute(update(jobs_table).where(JOB.id == job_id).values(status="cancelled", cancelled_at=now))
