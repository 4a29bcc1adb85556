"""Eval runs in the job store: recording a run and its metrics, and finding them again (storage/eval_records.py
holds the values). eval_history runs light_sql's statements, which `layerbus eval history` also runs without
SQLAlchemy.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, and_, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from layerbus.storage import light_sql
from layerbus.storage.clock import utc_now
from layerbus.storage.errors import StoreError
from layerbus.storage.eval_records import (
    EvalMetric,
    EvalRun,
    fingerprint_hash,
    metric_from_row,
    metric_order,
)
from layerbus.storage.light_sql import EVAL_METRIC_COLUMNS, EVAL_RUN_COLUMNS, check_limit
from layerbus.storage.schema import eval_metrics as metrics_table
from layerbus.storage.schema import eval_runs as runs_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.store_db import StoreDb

RUN = runs_table.c
METRIC = metrics_table.c
# Where a user finds the recorded runs, for messages.
_LIST_RUNS = "`SELECT job_id, suite, created_at FROM eval_runs ORDER BY created_at DESC` lists the recorded runs"
_RUN_COLUMNS = tuple(RUN[name] for name in EVAL_RUN_COLUMNS)
_METRIC_COLUMNS = tuple(METRIC[name] for name in EVAL_METRIC_COLUMNS)


class EvalStore:
    """JobStore's record_eval_run, finish_eval_run, eval_run, eval_runs, previous_eval_run, eval_metrics and
    eval_history."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    # --- writing ----------------------------------------------------------------------------------

    def record_eval_run(self, run: EvalRun) -> None:
        """Record that job `run.job_id` is an eval run; StoreError if the job is missing or already has a run.

        ValueError when fingerprint_hash is not the sha256 of fingerprint_json (see canonical_fingerprint),
        a JSON field is not JSON, or a time is naive.
        """
        row = run_row(run)
        with self._db.write() as conn:
            if conn.execute(select(jobs_table.c.id).where(jobs_table.c.id == run.job_id)).one_or_none() is None:
                raise StoreError(
                    f"cannot record an eval run for job {run.job_id!r}: no such job in {self._db.url}; create the "
                    "eval job first (its items are the documents), `layerbus status` lists the jobs"
                )
            if _run_exists(conn, run.job_id):
                raise self._already_recorded(run.job_id)
            try:
                conn.execute(insert(runs_table), row)
            except IntegrityError as exc:  # a concurrent recorder of the same job won (PostgreSQL)
                raise self._already_recorded(run.job_id) from exc

    def finish_eval_run(self, job_id: str, samples_path: str | Path | None, results_path: str | Path | None,
                        metrics: Sequence[EvalMetric], now: datetime | None) -> None:
        """Set the run's samples and results paths and finished_at, and replace all its metric rows with `metrics`.

        Atomic: finishing again (a re-finalize after a crash) leaves exactly `metrics`, nothing lost or doubled.
        NaN values are stored as NULL. StoreError when the job has no recorded eval run.
        """
        now = utc_now(now)
        rows = metric_rows(job_id, metrics)
        with self._db.write() as conn:
            if conn.execute(self._db.locking(select(RUN.job_id).where(RUN.job_id == job_id))).one_or_none() is None:
                raise self._no_run(job_id)
            conn.execute(
                update(runs_table)
                .where(RUN.job_id == job_id)
                .values(samples_path=_path(samples_path), results_path=_path(results_path), finished_at=now)
            )
            conn.execute(delete(metrics_table).where(METRIC.job_id == job_id))
            if rows:
                conn.execute(insert(metrics_table), rows)

    # --- reading ----------------------------------------------------------------------------------

    def eval_run(self, job_id: str) -> EvalRun:
        """The eval run of job `job_id`; StoreError naming the job when it has none."""
        with self._db.read() as conn:
            return self._run(conn, job_id)

    def eval_runs(self, suite: str | None, limit: int, include_unfinished: bool) -> list[EvalRun]:
        """The `limit` newest finished runs (created_at, then job_id, descending), of one suite unless None.

        suite "" selects the ad-hoc runs; include_unfinished adds runs not finished (running or crashed).
        """
        check_limit("eval_runs", limit)
        query = select(*_RUN_COLUMNS)
        if suite is not None:
            query = query.where(RUN.suite == suite)
        if not include_unfinished:
            query = query.where(RUN.finished_at.is_not(None))
        query = query.order_by(RUN.created_at.desc(), RUN.job_id.desc()).limit(limit)
        with self._db.read() as conn:
            return [EvalRun(*row) for row in conn.execute(query)]

    def previous_eval_run(self, suite: str, before_job_id: str) -> EvalRun | None:
        """The latest finished run of `suite` created before run `before_job_id` (ties: lower job id), or None.

        StoreError when `before_job_id` has no recorded eval run.
        """
        with self._db.read() as conn:
            before = self._run(conn, before_job_id)
            earlier = or_(
                RUN.created_at < before.created_at,
                and_(RUN.created_at == before.created_at, RUN.job_id < before.job_id),
            )
            query = (
                select(*_RUN_COLUMNS)
                .where(RUN.suite == suite, RUN.finished_at.is_not(None), earlier)
                .order_by(RUN.created_at.desc(), RUN.job_id.desc())
                .limit(1)
            )
            row = conn.execute(query).one_or_none()
        return None if row is None else EvalRun(*row)

    def eval_metrics(self, job_id: str) -> list[EvalMetric]:
        """The run's metrics ordered by task, metric, filter ([] until finished); StoreError when there is no run."""
        with self._db.read() as conn:
            if not _run_exists(conn, job_id):
                raise self._no_run(job_id)
            rows = conn.execute(select(*_METRIC_COLUMNS).where(METRIC.job_id == job_id)).all()
        return sorted((metric_from_row(row) for row in rows), key=metric_order)

    def eval_history(self, suite: str, metric: str | None, limit: int) -> list[tuple[EvalRun, list[EvalMetric]]]:
        """The suite's last `limit` finished runs, oldest first, each with its metrics (only `metric`'s, if given).

        Two queries: the runs, then their metrics.
        """
        with self._db.read() as conn:
            return light_sql.eval_history(self._db.statements(conn), suite, metric, limit)

    # --- messages and helpers ---------------------------------------------------------------------

    def _run(self, conn: Connection, job_id: str) -> EvalRun:
        row = conn.execute(select(*_RUN_COLUMNS).where(RUN.job_id == job_id)).one_or_none()
        if row is None:
            raise self._no_run(job_id)
        return EvalRun(*row)

    def _no_run(self, job_id: str) -> StoreError:
        return StoreError(
            f"no eval run {job_id} in {self._db.url}: that job has no recorded eval run (it is not an eval, or its "
            f"run was never recorded); {_LIST_RUNS}"
        )

    def _already_recorded(self, job_id: str) -> StoreError:
        return StoreError(
            f"an eval run of job {job_id} is already recorded in {self._db.url}; set its paths and metrics with "
            "finish_eval_run(), or record a new run under a new job"
        )


def _run_exists(conn: Connection, job_id: str) -> bool:
    return conn.execute(select(RUN.job_id).where(RUN.job_id == job_id)).one_or_none() is not None


def run_row(run: EvalRun) -> dict[str, Any]:
    """The eval_runs row for `run`; ValueError names a fingerprint or JSON field the row must not hold."""
    for name in ("fingerprint_json", "settings_json"):
        try:
            json.loads(getattr(run, name))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"eval run {run.job_id}: {name} is not JSON text ({exc}); pass json.dumps(...)") from exc
    for name in ("created_at", "finished_at"):
        stamp = getattr(run, name)
        if stamp is not None and stamp.tzinfo is None:
            raise ValueError(
                f"eval run {run.job_id}: naive datetime {stamp.isoformat()} as {name}: pass an aware one, "
                "e.g. datetime.now(timezone.utc)"
            )
    actual = fingerprint_hash(run.fingerprint_json)
    if run.fingerprint_hash != actual:
        raise ValueError(
            f"eval run {run.job_id}: fingerprint_hash {run.fingerprint_hash!r} is not the sha256 of its "
            f"fingerprint_json ({actual}); build both with storage.eval_records.canonical_fingerprint(fingerprint)"
        )
    return {
        "job_id": run.job_id, "suite": run.suite, "model": run.model, "fingerprint_hash": run.fingerprint_hash,
        "fingerprint_json": run.fingerprint_json, "settings_json": run.settings_json,
        "samples_path": _path(run.samples_path), "results_path": _path(run.results_path),
        "created_at": run.created_at, "finished_at": run.finished_at,
    }  # fmt: skip


def metric_rows(job_id: str, metrics: Sequence[EvalMetric]) -> list[dict[str, Any]]:
    """The eval_metrics rows of a run; ValueError names a repeated (task, metric, filter) or a bad field."""
    keys = Counter((m.task, m.metric, m.filter) for m in metrics)
    repeated = [key for key, count in keys.items() if count > 1]
    if repeated:
        task, metric, filter_name = repeated[0]
        raise ValueError(
            f"eval run {job_id}: task {task!r} metric {metric!r} filter {filter_name!r} appears more than once "
            f"({len(repeated)} repeated key(s)); give each (task, metric, filter) one value, nothing was written"
        )
    rows = []
    for m in metrics:
        for name in ("task", "metric", "filter"):
            if not isinstance(getattr(m, name), str) or not getattr(m, name):
                raise ValueError(f"eval run {job_id}: {name} {getattr(m, name)!r} of {m} must be a non-empty string")
        if isinstance(m.n, bool) or not isinstance(m.n, int) or m.n < 0:
            raise ValueError(f"eval run {job_id}: n={m.n!r} of task {m.task!r} must be a whole number >= 0")
        rows.append({
            "job_id": job_id, "task": m.task, "metric": m.metric, "filter": m.filter,
            "value": _finite_or_null(m.value), "stderr": _finite_or_null(m.stderr), "n": m.n,
        })  # fmt: skip
    return rows


def _finite_or_null(value: float | None) -> float | None:
    """NULL for None and NaN (PostgreSQL would keep a NaN, SQLite would not: NULL on both); infinities are kept."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _path(path: str | Path | None) -> str | None:
    return None if path is None else str(path)
