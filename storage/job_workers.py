"""The brokers working a job, in `job_workers`: one row per broker, written when it starts the job, by
each of its completions (in the completion's transaction), by each lease renewal, and when it stops.

Several brokers may work one job (storage/leases.py); `layerbus status JOB` lists them from these few
rows instead of grouping the job's items by holder (a million rows). JobWorkers holds JobStore's worker
calls; count_done and stamp also run inside the transactions of completions, lease renewals and
finalization renewals (storage/lease_store.py, storage/finalization.py). The rows are read back with
light_sql.job_workers, which `layerbus status` also runs without SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from sqlalchemy import Connection, insert, update

from layerbus.storage import light_sql
from layerbus.storage.clock import utc_now
from layerbus.storage.schema import job_workers as workers_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.status_records import JobWorker
from layerbus.storage.store_db import StoreDb

JOB = jobs_table.c
WORKER = workers_table.c
# A worker's states: `working` from its start, `finalizing` while it builds the final results file,
# `stopped` once its run of the job ended (a killed one stays as it was; readers show it `lost`).
WORKER_STATES = ("working", "finalizing", "stopped")


class JobWorkers:
    """JobStore's register_worker, set_worker_state and job_workers."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    def register_worker(self, job_id: str, worker: str, host: str, chain: str | None, lease_s: float,
                        now: datetime | None) -> None:
        """Record that `worker` ("host:pid:token") works the job, on `host`, with `chain` (its stages in
        text form), renewing every lease within `lease_s`; `layerbus status JOB` lists it."""
        now = utc_now(now)
        with self._db.write() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            register(conn, job_id, worker, host, chain, lease_s, now)

    def set_worker_state(self, job_id: str, worker: str, state: str, now: datetime | None) -> None:
        """Set `worker`'s state on the job (working, finalizing, stopped) and stamp its last renewal."""
        now = utc_now(now)
        with self._db.write() as conn:
            stamp(conn, job_id, worker, now, state)

    def job_workers(self, job_id: str) -> list[JobWorker]:
        """The brokers that worked the job, in the order they started."""
        with self._db.read() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            return light_sql.job_workers(self._db.statements(conn), job_id)


def register(conn: Connection, job_id: str, worker: str, host: str, chain: str | None, lease_s: float,
             now: datetime) -> None:
    """Record that `worker` works the job from `now`; a worker that worked it before in this process
    keeps its counts and start, and is working again."""
    key = (WORKER.job_id == job_id) & (WORKER.worker == worker)
    values = {"state": "working", "chain": chain, "lease_s": lease_s, "renewed_at": now}
    if conn.execute(update(workers_table).where(key).values(**values)).rowcount == 0:
        conn.execute(insert(workers_table), {"job_id": job_id, "worker": worker, "host": host, "items_done": 0,
                                             "completion_tokens": 0, "started_at": now, **values})


def count_done(conn: Connection, worker: str, done: Mapping[str, tuple[int, int]]) -> None:
    """Add to `worker`'s counts what it just recorded: job_id -> (items, generated tokens)."""
    for job_id in sorted(done):  # one order for every writer (PostgreSQL row locks)
        items, tokens = done[job_id]
        conn.execute(
            update(workers_table)
            .where(WORKER.job_id == job_id, WORKER.worker == worker)
            .values(items_done=WORKER.items_done + items, completion_tokens=WORKER.completion_tokens + tokens)
        )


def stamp(conn: Connection, job_id: str, worker: str, now: datetime, state: str | None = None) -> None:
    """Stamp `worker`'s last renewal with `now`, and set its state if given."""
    if state is not None and state not in WORKER_STATES:
        raise ValueError(f"worker state {state!r}: use one of {', '.join(WORKER_STATES)}")
    values: dict[str, object] = {"renewed_at": now}
    if state is not None:
        values["state"] = state
    conn.execute(update(workers_table).where(WORKER.job_id == job_id, WORKER.worker == worker).values(**values))
