"""Exactly one broker finalizes a job (builds its final results file from the store and ends it), however
many work it: the one whose claim moves the job from in_progress, with nothing queued or in flight, to
finalizing. Its hold is a lease like an item's: it renews it while writing, and once it runs out (or its
holder is known to be gone) another broker takes the finalization over, so a finalizer killed mid-write
does not leave the job finalizing for ever. A cancelled job's file (the outputs finished before the
cancel) is claimed the same way. Writing the file itself is storage/results.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Select, select, update

from layerbus.storage import job_workers as workers
from layerbus.storage.clock import utc_now
from layerbus.storage.errors import StoreError
from layerbus.storage.item_counts import read_counts
from layerbus.storage.leases import lease_end
from layerbus.storage.records import Finalization
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.states import UNFINISHED_ITEM_STATES, check_job_transition, timestamp_column
from layerbus.storage.store_db import StoreDb

JOB = jobs_table.c
# Jobs whose final file a worker may claim to write: one finishing, and a cancelled one without its file.
_TO_WRITE = ("finalizing", "cancelled")


class Finalizations:
    """JobStore's claim_finalization, job_finalization, renew_finalization and finish_finalization."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    def claim_finalization(self, job_id: str, worker: str, lease_s: float, gone: Sequence[str],
                           now: datetime | None) -> Finalization:
        """Make `worker` the one broker that finalizes the job, if it is due and nobody else holds it.

        Due: the job is in_progress with nothing queued or in flight (the claim moves it to finalizing), or
        finalizing, or cancelled without its results file. Held: by another worker whose hold has not run
        out (`now + lease_s` from its claim or last renew_finalization) and who is not in `gone` (workers
        known to have exited). The answer says who holds it either way.
        """
        now = utc_now(now)
        expires = lease_end(now, lease_s)
        with self._db.write() as conn:
            row = _locked_job(conn, job_id, self._db.locking)
            if row.status == "in_progress":
                counts = read_counts(conn, [job_id]).get(job_id, [])
                if any(count.count > 0 for count in counts if count.status in UNFINISHED_ITEM_STATES):
                    return Finalization(False, row.status, row.finalized_by, row.finalize_lease_expires_at)
                conn.execute(update(jobs_table).where(JOB.id == job_id).values(
                    status="finalizing", finalizing_at=now, finalized_by=worker, finalize_lease_expires_at=expires))
                return Finalization(True, "finalizing", worker, expires)
            due = row.status == "finalizing" or (row.status == "cancelled" and row.results_path is None)
            holder, until = row.finalized_by, row.finalize_lease_expires_at
            free = holder is None or holder == worker or holder in gone or until is None or until < now
            if not (due and free):
                return Finalization(False, row.status, holder, until)
            conn.execute(update(jobs_table).where(JOB.id == job_id).values(finalized_by=worker,
                                                                           finalize_lease_expires_at=expires))
            return Finalization(True, row.status, worker, expires)

    def job_finalization(self, job_id: str) -> Finalization:
        """Who finalizes (or finalized) the job and until when its hold runs; `claimed` is always False."""
        with self._db.read() as conn:
            row = _locked_job(conn, job_id, lambda query: query)
        return Finalization(False, row.status, row.finalized_by, row.finalize_lease_expires_at)

    def renew_finalization(self, job_id: str, worker: str, lease_s: float, now: datetime | None) -> bool:
        """Push `worker`'s hold on the job's finalization to `now + lease_s`; False when it holds none (taken
        over, or done)."""
        now = utc_now(now)
        with self._db.write() as conn:
            moved = conn.execute(
                update(jobs_table)
                .where(JOB.id == job_id, JOB.finalized_by == worker, JOB.finalize_lease_expires_at.is_not(None),
                       JOB.status.in_(_TO_WRITE))
                .values(finalize_lease_expires_at=lease_end(now, lease_s))
            )
            held = moved.rowcount == 1
            if held:
                workers.stamp(conn, job_id, worker, now)
            return held

    def finish_finalization(self, job_id: str, worker: str, results_path: str | Path, status: str | None,
                            error: str | None, now: datetime | None) -> bool:
        """Record the results file `worker` wrote and move the job to `status` (completed or failed; None
        for a cancelled job, which stays cancelled), releasing the hold; False, changing nothing, when
        `worker` no longer holds the finalization (its hold ran out and another broker took it over)."""
        now = utc_now(now)
        with self._db.write() as conn:
            row = _locked_job(conn, job_id, self._db.locking)
            if row.finalized_by != worker or row.finalize_lease_expires_at is None or row.status not in _TO_WRITE:
                return False
            values: dict[str, Any] = {"results_path": str(results_path), "finalize_lease_expires_at": None}
            if status is not None:
                check_job_transition(job_id, row.status, status)
                values.update({"status": status, timestamp_column(status): now})
            if error is not None:
                values["error"] = error
            conn.execute(update(jobs_table).where(JOB.id == job_id).values(**values))
            return True


def _locked_job(conn: Connection, job_id: str, locking: Callable[[Select[Any]], Select[Any]]) -> Any:
    query = select(JOB.status, JOB.results_path, JOB.finalized_by, JOB.finalize_lease_expires_at).where(
        JOB.id == job_id)
    row = conn.execute(locking(query)).one_or_none()
    if row is None:
        raise StoreError(f"no job {job_id!r} in the store; `layerbus status` lists the jobs")
    return row
