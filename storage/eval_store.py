"""The eval queries of the job store: recording eval runs and their metrics, and finding them again.

JobStore's eval methods are thin: each opens its one transaction and calls one method here with the
connection, so this module holds the SQL and the row conversions and never opens a transaction itself.
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

from layerbus.storage.errors import StoreError
from layerbus.storage.eval_records import (
    EvalMetric,
    EvalRun,
    fingerprint_hash,
    metric_from_row,
    metric_order,
)
from layerbus.storage.schema import eval_metrics as metrics_table
from layerbus.storage.schema import eval_runs as runs_table
from layerbus.storage.schema import jobs as jobs_table

RUN = runs_table.c
METRIC = metrics_table.c
# Where a user finds the recorded runs, for messages.
_LIST_RUNS = "`SELECT job_id, suite, created_at FROM eval_runs ORDER BY created_at DESC` lists the recorded runs"
_RUN_COLUMNS = (RUN.job_id, RUN.suite, RUN.model, RUN.fingerprint_hash, RUN.fingerprint_json, RUN.settings_json,
                RUN.created_at, RUN.samples_path, RUN.results_path, RUN.finished_at)  # fmt: skip
_METRIC_COLUMNS = (METRIC.task, METRIC.metric, METRIC.filter, METRIC.value, METRIC.stderr, METRIC.n)


class EvalTables:
    """Reads and writes of eval_runs and eval_metrics on a connection the caller's transaction holds."""

    def __init__(self, url: str, row_locks: bool) -> None:
        # The store's URL with its password masked, for messages.
        self.url = url
        # Whether to lock rows with FOR UPDATE (PostgreSQL); SQLite's BEGIN IMMEDIATE locks the database.
        self._row_locks = row_locks

    # --- writing ----------------------------------------------------------------------------------

    def record(self, conn: Connection, run: EvalRun) -> None:
        """Insert `run`; StoreError when its job does not exist or already has a run."""
        row = run_row(run)
        if conn.execute(select(jobs_table.c.id).where(jobs_table.c.id == run.job_id)).one_or_none() is None:
            raise StoreError(
                f"cannot record an eval run for job {run.job_id!r}: no such job in {self.url}; create the eval "
                "job first (its items are the documents), `layerbus status` lists the jobs"
            )
        if self._run_exists(conn, run.job_id):
            raise self._already_recorded(run.job_id)
        try:
            conn.execute(insert(runs_table), row)
        except IntegrityError as exc:  # a concurrent recorder of the same job won (PostgreSQL)
            raise self._already_recorded(run.job_id) from exc

    def finish(
        self,
        conn: Connection,
        job_id: str,
        samples_path: str | Path | None,
        results_path: str | Path | None,
        metrics: Sequence[EvalMetric],
        now: datetime,
    ) -> None:
        """Set the run's paths and finished_at and replace all its metric rows with `metrics`."""
        rows = metric_rows(job_id, metrics)
        query = select(RUN.job_id).where(RUN.job_id == job_id)
        if self._row_locks:
            query = query.with_for_update()
        if conn.execute(query).one_or_none() is None:
            raise self.no_run(job_id)
        conn.execute(
            update(runs_table)
            .where(RUN.job_id == job_id)
            .values(samples_path=_path(samples_path), results_path=_path(results_path), finished_at=now)
        )
        conn.execute(delete(metrics_table).where(METRIC.job_id == job_id))
        if rows:
            conn.execute(insert(metrics_table), rows)

    # --- reading ----------------------------------------------------------------------------------

    def run(self, conn: Connection, job_id: str) -> EvalRun:
        row = conn.execute(select(*_RUN_COLUMNS).where(RUN.job_id == job_id)).one_or_none()
        if row is None:
            raise self.no_run(job_id)
        return EvalRun(*row)

    def runs(self, conn: Connection, suite: str | None, limit: int, include_unfinished: bool) -> list[EvalRun]:
        """Runs newest first (created_at, then job_id); of one suite unless `suite` is None."""
        _check_limit("eval_runs", limit)
        query = select(*_RUN_COLUMNS)
        if suite is not None:
            query = query.where(RUN.suite == suite)
        if not include_unfinished:
            query = query.where(RUN.finished_at.is_not(None))
        query = query.order_by(RUN.created_at.desc(), RUN.job_id.desc()).limit(limit)
        return [EvalRun(*row) for row in conn.execute(query)]

    def previous(self, conn: Connection, suite: str, before_job_id: str) -> EvalRun | None:
        """The suite's latest finished run that comes before run `before_job_id` in (created_at, job_id) order."""
        before = self.run(conn, before_job_id)
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

    def metrics(self, conn: Connection, job_id: str) -> list[EvalMetric]:
        """The run's metrics ordered by task, metric, filter; StoreError when there is no such run."""
        if not self._run_exists(conn, job_id):
            raise self.no_run(job_id)
        rows = conn.execute(select(*_METRIC_COLUMNS).where(METRIC.job_id == job_id))
        return sorted((metric_from_row(row) for row in rows), key=metric_order)

    def history(
        self, conn: Connection, suite: str, metric: str | None, limit: int
    ) -> list[tuple[EvalRun, list[EvalMetric]]]:
        """The suite's last `limit` finished runs, oldest first, each with its metrics (only `metric`'s, if given)."""
        _check_limit("eval_history", limit)
        runs = self.runs(conn, suite, limit, include_unfinished=False)
        runs.reverse()
        query = select(METRIC.job_id, *_METRIC_COLUMNS).where(METRIC.job_id.in_([r.job_id for r in runs]))
        if metric is not None:
            query = query.where(METRIC.metric == metric)
        per_run: dict[str, list[EvalMetric]] = {r.job_id: [] for r in runs}
        if runs:
            for job_id, *values in conn.execute(query):
                per_run[job_id].append(metric_from_row(values))
        return [(r, sorted(per_run[r.job_id], key=metric_order)) for r in runs]

    # --- messages and helpers ---------------------------------------------------------------------

    def no_run(self, job_id: str) -> StoreError:
        return StoreError(
            f"no eval run {job_id} in {self.url}: that job has no recorded eval run (it is not an eval, or its "
            f"run was never recorded); {_LIST_RUNS}"
        )

    def _already_recorded(self, job_id: str) -> StoreError:
        return StoreError(
            f"an eval run of job {job_id} is already recorded in {self.url}; set its paths and metrics with "
            "finish_eval_run(), or record a new run under a new job"
        )

    def _run_exists(self, conn: Connection, job_id: str) -> bool:
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


def _check_limit(method: str, limit: int) -> None:
    if limit < 1:
        raise ValueError(f"{method} needs limit >= 1, got {limit=}")
