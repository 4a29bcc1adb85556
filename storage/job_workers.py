"""The brokers working a job, in `job_workers`: one row per broker, written when it starts the job, by
each of its completions (in the completion's transaction), by each lease renewal, and when it stops.

Several brokers may work one job (storage/leases.py); `layerbus status JOB` lists them from these few
rows instead of grouping the job's items by holder (a million rows). The functions here run inside a
JobStore transaction; JobStore's methods are the interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from sqlalchemy import Connection, insert, select, update

from layerbus.storage.schema import job_workers as workers_table
from layerbus.storage.status_records import WORKER_FIELDS, JobWorker, worker_from_row

WORKER = workers_table.c
# A worker's states: `working` from its start, `finalizing` while it builds the final results file,
# `stopped` once its run of the job ended (a killed one stays as it was; readers show it `lost`).
WORKER_STATES = ("working", "finalizing", "stopped")


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


def job_workers(conn: Connection, job_id: str) -> list[JobWorker]:
    """The job's workers in the order they started."""
    query = (select(*(WORKER[name] for name in WORKER_FIELDS)).where(WORKER.job_id == job_id)
             .order_by(WORKER.started_at, WORKER.worker))
    return [worker_from_row(dict(zip(WORKER_FIELDS, row))) for row in conn.execute(query)]

