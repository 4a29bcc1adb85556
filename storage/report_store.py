"""What brokers report of a running job for the people watching it: its events (`layerbus status`: a stage
lost, a re-plan, a recovery, storage/events.py) and each broker's latest view of its stages (`layerbus top`,
storage/snapshot_records.py). The reads are light_sql's, which `status` and `top` also run without SQLAlchemy."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, insert

from layerbus.storage import light_sql
from layerbus.storage.clock import utc_now
from layerbus.storage.events import event_row
from layerbus.storage.schema import job_events as events_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.schema import stage_snapshots as snapshots_table
from layerbus.storage.snapshot_records import MAX_BROKER_CHARS, StageSnapshot, snapshot_row
from layerbus.storage.status_records import JobEvent
from layerbus.storage.store_db import StoreDb

JOB = jobs_table.c
SNAPSHOT = snapshots_table.c


class JobReports:
    """JobStore's add_job_event, job_events, record_stage_snapshots and stage_snapshots."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    def add_job_event(self, job_id: str, kind: str, message: str, duration_s: float | None,
                      now: datetime | None) -> None:
        """Record what happened to a job (kind e.g. stage_lost, recovered) for `layerbus status`.

        Messages beyond storage.events.MAX_EVENT_MESSAGE_CHARS are cut; duration_s is how long it took, if a span.
        """
        row = event_row(job_id, kind, message, duration_s, utc_now(now))
        with self._db.write() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            conn.execute(insert(events_table), row)

    def job_events(self, job_id: str, limit: int) -> list[JobEvent]:
        """The job's last `limit` events, oldest first."""
        light_sql.check_limit("job_events", limit)
        with self._db.read() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            return light_sql.job_events(self._db.statements(conn), job_id, limit)

    def record_stage_snapshots(self, job_id: str, broker: str, snapshots: Sequence[StageSnapshot],
                               now: datetime | None) -> None:
        """Replace `broker`'s stage snapshots of the job with `snapshots`, stamped `now` (`layerbus top`).

        One short transaction: the broker's earlier rows go, so a stage it no longer knows leaves the view.
        """
        now = utc_now(now)
        rows = [snapshot_row(job_id, broker, snapshot, now) for snapshot in snapshots]
        with self._db.write() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            conn.execute(delete(snapshots_table).where(SNAPSHOT.job_id == job_id,
                                                       SNAPSHOT.broker == broker[:MAX_BROKER_CHARS]))
            if rows:
                conn.execute(insert(snapshots_table), rows)

    def stage_snapshots(self, job_id: str) -> list[StageSnapshot]:
        """Every broker's latest view of the job's stages, by broker, then in chain order (snapshot_order)."""
        with self._db.read() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            return light_sql.stage_snapshots(self._db.statements(conn), job_id)
