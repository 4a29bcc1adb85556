"""JobStore.cancel_job through the store's driver alone (sqlite3, libpq or psycopg, storage/direct_db.py).

A cancel is three statements whatever the job's size (storage/item_counts.py: the job's cancelling_at
marks its queued items, whose rows stay), so a whole `layerbus cancel` is mostly Python's start and its
imports: SQLAlchemy's alone took 130-240 ms here, psycopg's adds 90 ms more on PostgreSQL. This runs the
cancel JobStore runs (storage/light_sql.py: the same statements in the same lock order), in a transaction
of its own; the store's contract suite cancels through both. Where it cannot answer (a URL direct_db does
not take, no such job, a job that cannot be cancelled, a schema it does not know) it changes nothing and
returns None: the full store then does the cancel, or words the error.
"""

from __future__ import annotations

from contextlib import closing
from datetime import datetime

from layerbus.storage import light_sql
from layerbus.storage.direct_db import direct_db


def cancel_job_directly(url: str, job_id: str, now: datetime | None = None) -> str | None:
    """Cancel `job_id` as JobStore.cancel_job does and return its new status; None when this path cannot."""
    db = direct_db(url)
    if db is None:
        return None
    try:
        with closing(db.connect(write=True)) as conn:
            # SQLite: IMMEDIATE takes the write lock now, as the full store's writes do (storage.engine).
            conn.execute("BEGIN IMMEDIATE" if db.kind == "sqlite" else "BEGIN")
            try:
                target = light_sql.cancel_job(db.statements(conn), db.kind, job_id, now).status
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT" if target is not None else "ROLLBACK")
            return target
    except db.error:  # another schema, locked beyond the timeout: the full store decides
        return None
