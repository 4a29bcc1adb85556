"""Submitting jobs to the store: a whole job in one transaction, or a job filled a chunk at a time while it
is validating and then queued (or discarded). Validation happens before, in jobs/."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, insert, update
from sqlalchemy.exc import IntegrityError

from layerbus.storage.clock import utc_now
from layerbus.storage.errors import StoreError
from layerbus.storage.item_counts import CountChanges, insert_counts
from layerbus.storage.records import InvalidItem, JobSettings, NewItem
from layerbus.storage.rows import duplicate_message, insert_new_items, invalid_item_row, new_item_row
from layerbus.storage.schema import item_counts as counts_table
from layerbus.storage.schema import items as items_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.status import StateAggregate
from layerbus.storage.store_db import StoreDb

JOB = jobs_table.c


def new_job_id() -> str:
    return "job_" + secrets.token_hex(6)


class Submissions:
    """JobStore's create_job, begin_job, add_items and discard_job."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    def create_job(self, settings: JobSettings, items: Sequence[NewItem], invalid_items: Sequence[InvalidItem],
                   now: datetime | None) -> str:
        """Store a job and all its items in one transaction, queued; returns the new job id.

        Validation happens before (in jobs/), so the job is stored already past validating; both
        created_at and queued_at are stamped. Invalid items are stored as failed, finish_reason 'error'.
        """
        now = utc_now(now)
        job_id = new_job_id()
        rows = [new_item_row(job_id, item) for item in items]
        rows += [invalid_item_row(job_id, item, now) for item in invalid_items]
        job_row = {**_job_row(job_id, settings, "queued", now), "total_count": len(rows), "queued_at": now}
        try:
            with self._db.write() as conn:
                conn.execute(insert(jobs_table), job_row)
                if rows:
                    conn.execute(insert(items_table), rows)
                waiting = sum(1 for item in items if item.status == "waiting")
                insert_counts(conn, job_id, [StateAggregate("queued", len(items) - waiting, 0, 0, 0),
                                             StateAggregate("waiting", waiting, 0, 0, 0),
                                             StateAggregate("failed", len(invalid_items), 0, 0, 0)])
        except IntegrityError as exc:
            raise StoreError(duplicate_message(rows, exc)) from exc
        return job_id

    def begin_job(self, settings: JobSettings, now: datetime | None) -> str:
        """Store a new job as validating, with no items yet; returns its id.

        For inputs too large to hold: add_items fills it a chunk at a time, set_job_status(job_id, "queued")
        makes it runnable once the whole input passed, discard_job removes it when it did not. No broker
        claims from a validating job, so nothing of it runs before it is queued.
        """
        job_id = new_job_id()
        job_row = _job_row(job_id, settings, "validating", utc_now(now))
        with self._db.write() as conn:
            conn.execute(insert(jobs_table), job_row)
            insert_counts(conn, job_id, [])
        return job_id

    def add_items(self, job_id: str, items: Sequence[NewItem], invalid_items: Sequence[InvalidItem],
                  now: datetime | None) -> None:
        """Add items to a validating job (begin_job) in one transaction: valid ones queued, invalid ones failed."""
        now = utc_now(now)
        rows = [invalid_item_row(job_id, item, now) for item in invalid_items]
        try:
            with self._db.write() as conn:
                status = self._db.job_field(conn, job_id, JOB.status)
                if status != "validating":
                    raise StoreError(f"job {job_id!r} is {status}: items are added only while it is validating")
                if items:
                    insert_new_items(conn, job_id, items)
                if rows:
                    conn.execute(insert(items_table), rows)
                changes = CountChanges()
                waiting = sum(1 for item in items if item.status == "waiting")
                changes.add(job_id, "queued", len(items) - waiting, 0)
                changes.add(job_id, "waiting", waiting, 0)
                changes.add(job_id, "failed", len(invalid_items), 0)
                changes.apply(conn)
                added = len(items) + len(rows)
                conn.execute(update(jobs_table).where(JOB.id == job_id).values(total_count=JOB.total_count + added))
        except IntegrityError as exc:
            raise StoreError(duplicate_message([new_item_row(job_id, item) for item in items] + rows, exc)) from exc

    def discard_job(self, job_id: str) -> None:
        """Delete a validating job with its items: a refused input leaves nothing behind."""
        with self._db.write() as conn:
            status = self._db.job_field(conn, job_id, JOB.status)
            if status != "validating":
                raise StoreError(f"job {job_id!r} is {status}: only a validating job can be discarded")
            for table in (items_table, counts_table):  # its rows first: SQLite enforces the cascade only when asked
                conn.execute(delete(table).where(table.c.job_id == job_id))
            conn.execute(delete(jobs_table).where(JOB.id == job_id))


def _job_row(job_id: str, settings: JobSettings, status: str, created_at: datetime) -> dict[str, object]:
    """The jobs row of a new job in `status`, with no items counted yet."""
    return {
        "id": job_id, "name": settings.name, "task": settings.task, "model": settings.model,
        "settings_json": settings.to_json(), "input_path": settings.input_path, "results_path": None,
        "status": status, "total_count": 0, "error": None, "created_at": created_at,
    }  # fmt: skip
