"""Exactly one broker finalizes a job (builds its final results file from the store and ends it), however
many work it: the one whose claim moves the job from in_progress, with nothing queued or in flight, to
finalizing. Its hold is a lease like an item's: it renews it while writing, and once it runs out (or its
holder is known to be gone) another broker takes the finalization over, so a finalizer killed mid-write
does not leave the job finalizing for ever. A cancelled job's file (the outputs finished before the
cancel) is claimed the same way. The functions here run inside a JobStore transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Select, select, update

from layerbus.storage.errors import StoreError
from layerbus.storage.item_counts import read_counts
from layerbus.storage.leases import lease_end
from layerbus.storage.records import Finalization
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.states import check_job_transition, timestamp_column

JOB = jobs_table.c
# Jobs whose final file a worker may claim to write: one finishing, and a cancelled one without its file.
_TO_WRITE = ("finalizing", "cancelled")


def claim(conn: Connection, job_id: str, worker: str, now: datetime, lease_s: float, gone: Sequence[str],
          locking: Callable[[Select[Any]], Select[Any]]) -> Finalization:
    """Take the job's finalization for `worker` if it is due and nobody else holds it (see the module)."""
    expires = lease_end(now, lease_s)
    row = _locked_job(conn, job_id, locking)
    if row.status == "in_progress":
        counts = read_counts(conn, [job_id]).get(job_id, [])
        if any(count.count > 0 for count in counts if count.status in ("queued", "in_progress")):
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


def renew(conn: Connection, job_id: str, worker: str, now: datetime, lease_s: float) -> bool:
    """Push `worker`'s hold on the job's finalization on; False when it holds none (taken over, or done)."""
    moved = conn.execute(
        update(jobs_table)
        .where(JOB.id == job_id, JOB.finalized_by == worker, JOB.finalize_lease_expires_at.is_not(None),
               JOB.status.in_(_TO_WRITE))
        .values(finalize_lease_expires_at=lease_end(now, lease_s))
    )
    return moved.rowcount == 1


def finish(conn: Connection, job_id: str, worker: str, results_path: str, status: str | None, error: str | None,
           now: datetime, locking: Callable[[Select[Any]], Select[Any]]) -> bool:
    """Record the final file `worker` wrote and move the job to `status` (None: a cancelled job stays so);
    False, changing nothing, when `worker` no longer holds the finalization (another took it over)."""
    row = _locked_job(conn, job_id, locking)
    if row.finalized_by != worker or row.finalize_lease_expires_at is None or row.status not in _TO_WRITE:
        return False
    values: dict[str, Any] = {"results_path": results_path, "finalize_lease_expires_at": None}
    if status is not None:
        check_job_transition(job_id, row.status, status)
        values.update({"status": status, timestamp_column(status): now})
    if error is not None:
        values["error"] = error
    conn.execute(update(jobs_table).where(JOB.id == job_id).values(**values))
    return True


def read(conn: Connection, job_id: str) -> Finalization:
    row = _locked_job(conn, job_id, lambda query: query)
    return Finalization(False, row.status, row.finalized_by, row.finalize_lease_expires_at)


def _locked_job(conn: Connection, job_id: str, locking: Callable[[Select[Any]], Select[Any]]) -> Any:
    query = select(JOB.status, JOB.results_path, JOB.finalized_by, JOB.finalize_lease_expires_at).where(
        JOB.id == job_id)
    row = conn.execute(locking(query)).one_or_none()
    if row is None:
        raise StoreError(f"no job {job_id!r} in the store; `layerbus status` lists the jobs")
    return row
