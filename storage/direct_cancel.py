"""JobStore.cancel_job through the store's driver alone (sqlite3 or psycopg, storage/direct_db.py).

A cancel is three statements whatever the job's size (storage/item_counts.py: the job's cancelling_at
marks its queued items, whose rows stay), so a whole `layerbus cancel` is mostly Python's start and its
imports: SQLAlchemy's alone took 130-240 ms here, psycopg's adds 90 ms more on PostgreSQL. This is the same
transaction as JobStore.cancel_job, statement for statement and in the same lock order (the job's counters,
locked in state order on PostgreSQL, then the job row); a contract test runs both on the same stores. Where
it cannot answer (a URL direct_db does not take, no such job, a job that cannot be cancelled, a schema
it does not know) it changes nothing and returns None: the full store then does the cancel, or words the error.
"""

from __future__ import annotations

from contextlib import closing
from datetime import datetime, timezone

from layerbus.storage.direct_db import direct_db
from layerbus.storage.errors import StoreError
from layerbus.storage.states import CANCELLABLE_JOB_STATES

_JOB_STATUS = "SELECT status FROM jobs WHERE id = ?"
_IN_FLIGHT = "SELECT status, items FROM item_counts WHERE job_id = ? ORDER BY status"
_MARK = "UPDATE jobs SET status = ?, cancelling_at = ?{cancelled} WHERE id = ? AND status = ?"


def cancel_job_directly(url: str, job_id: str, now: datetime | None = None) -> str | None:
    """Cancel `job_id` as JobStore.cancel_job does and return its new status; None when this path cannot."""
    db = direct_db(url)
    if db is None:
        return None
    stamp = db.timestamp(now or datetime.now(timezone.utc))
    try:
        with closing(db.connect(write=True)) as conn:
            # SQLite: IMMEDIATE takes the write lock now, as the full store's writes do (storage.engine).
            conn.execute("BEGIN IMMEDIATE" if db.kind == "sqlite" else "BEGIN")
            try:
                target = _cancel(db, conn, job_id, stamp)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT" if target is not None else "ROLLBACK")
            return target
    except db.error:  # another schema, locked beyond the timeout: the full store decides
        return None


def _cancel(db, conn, job_id: str, stamp: object) -> str | None:  # type: ignore[no-untyped-def]
    row = conn.execute(db.sql(_JOB_STATUS), (job_id,)).fetchone()
    if row is None or row[0] not in (*CANCELLABLE_JOB_STATES, "cancelling", "cancelled"):
        return None  # the full store names the job and what it is
    current = row[0]
    if current in ("cancelling", "cancelled"):
        return current
    # Locking the counters waits out concurrent completions and requeues, so the in-flight count is final.
    locking = " FOR UPDATE" if db.kind == "postgresql" else ""
    counts = dict(conn.execute(db.sql(_IN_FLIGHT + locking), (job_id,)).fetchall())
    if "in_progress" not in counts:
        return None  # no counters for this job: JobStore.open fills them in
    target = "cancelling" if counts["in_progress"] else "cancelled"
    cancelled = ", cancelled_at = ?" if target == "cancelled" else ""
    params = (target, stamp, *((stamp,) if cancelled else ()), job_id, current)
    moved = conn.execute(db.sql(_MARK.format(cancelled=cancelled)), params)
    if moved.rowcount != 1:
        raise StoreError(f"job {job_id!r} changed state while being cancelled; run the cancel again")
    return target
