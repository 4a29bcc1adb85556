"""Reading jobs: a job's status, the newest jobs, finding one by state or name, the next one with work for a
broker, and a job's settings. Status and the newest jobs are light_sql's reads, which `layerbus status` also
runs without SQLAlchemy."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select

from layerbus.storage import light_sql
from layerbus.storage.records import JobSettings, JobStatus
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.states import RUNNABLE_JOB_STATES
from layerbus.storage.store_db import StoreDb

JOB = jobs_table.c


class JobReads:
    """JobStore's job_status, list_jobs, latest_job_id, find_job_by_name, next_runnable_job and job_settings."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    def job_status(self, job_id: str, now: datetime | None) -> JobStatus:
        """State, counts, throughput and ETA of one job (two queries, neither reading items)."""
        with self._db.read() as conn:
            status = light_sql.job_status(self._db.statements(conn), job_id, now)
        if status is None:
            raise self._db.no_job(job_id)
        return status

    def list_jobs(self, limit: int, now: datetime | None) -> list[JobStatus]:
        """The `limit` most recently created jobs, newest first."""
        with self._db.read() as conn:
            return light_sql.recent_jobs(self._db.statements(conn), limit, now)

    def latest_job_id(self, status: str | None) -> str | None:
        """The newest job (created_at, then id), or the newest in `status`; None when there is none."""
        with self._db.read() as conn:
            ids = light_sql.latest_job_ids(self._db.statements(conn), status, 1)
        return ids[0] if ids else None

    def find_job_by_name(self, name: str) -> str | None:
        """The newest job named `name` (created_at, then id), or None: how a caller that names its jobs by
        what they compute (lm-eval's adapter: a digest of model and items) finds its earlier run to resume."""
        if not name:
            raise ValueError("find_job_by_name needs a non-empty name: unnamed jobs all share the name ''")
        with self._db.read() as conn:
            query = select(JOB.id).where(JOB.name == name).order_by(JOB.created_at.desc(), JOB.id.desc()).limit(1)
            return conn.execute(query).scalar_one_or_none()

    def next_runnable_job(self) -> str | None:
        """The oldest job with work to hand out (queued or in_progress), or None."""
        with self._db.read() as conn:
            query = (
                select(JOB.id)
                .where(JOB.status.in_(RUNNABLE_JOB_STATES))
                .order_by(JOB.created_at, JOB.id)
                .limit(1)
            )
            return conn.execute(query).scalar_one_or_none()

    def job_settings(self, job_id: str) -> JobSettings:
        with self._db.read() as conn:
            return JobSettings.from_json(self._db.job_field(conn, job_id, JOB.settings_json))
