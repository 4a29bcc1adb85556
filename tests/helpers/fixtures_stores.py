"""The job store on both back ends: `store_url` is a fresh SQLite file, then a fresh PostgreSQL database
(marked `postgres`: the suite's throwaway server), and `store` the store opened on it.

`store` is a TwinPathStore: the reads that the light commands (`status`, `top`, `eval history`) also make
through the store's driver alone (storage/direct_status.py, storage/sqlite_evals.py) are made through both
paths on the same database, and every test fails where the two disagree. Its cancels go through JobStore,
or, in the tests marked `@CANCEL_PATHS`, once through each path (storage/direct_cancel.py).

Imported by name into the modules whose tests must hold on both (`from tests.helpers.fixtures_stores import store,
store_url`), since other modules define a `store` of their own, on SQLite only."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import pytest

from layerbus.storage import JobStore
from layerbus.storage.direct_cancel import cancel_job_directly
from layerbus.storage.direct_db import sqlite_file
from layerbus.storage.direct_status import (read_job_events, read_job_status, read_job_workers, read_latest_job_ids,
                                            read_recent_jobs, read_stage_snapshots)
from layerbus.storage.errors import StoreError
from layerbus.storage.events import DEFAULT_EVENT_LIMIT
from layerbus.storage.eval_records import DEFAULT_EVAL_LIMIT, EvalMetric, EvalRun
from layerbus.storage.records import JobEvent, JobStatus, JobWorker
from layerbus.storage.snapshot_records import StageSnapshot
from layerbus.storage.sqlite_evals import read_eval_history

# Runs a test once cancelling through JobStore.cancel_job, once through the direct path.
CANCEL_PATHS = pytest.mark.parametrize("store", ["full-cancel", "direct-cancel"], indirect=True)

Answer = TypeVar("Answer")


class TwinPathStore(JobStore):
    """A JobStore whose light-command reads are checked against the direct path's, and whose cancels take
    `cancel_path`. Open it with open_twin."""

    # The store's URL as given (JobStore.url masks the password): what the direct path connects to.
    raw_url: str
    # "full-cancel": cancel_job is JobStore's. "direct-cancel": cancel_job_directly's, which must answer for
    # every job the full store cancels; where it declines, the full store must refuse, and words why.
    cancel_path: str

    @classmethod
    def open_twin(cls, url: str, cancel_path: str = "full-cancel") -> TwinPathStore:
        store = cls.open(url)
        store.raw_url, store.cancel_path = url, cancel_path
        return store

    def job_status(self, job_id: str, now: datetime | None = None) -> JobStatus:
        now = now or datetime.now(timezone.utc)  # one clock reading for both: throughput and ETA depend on it
        return agree(lambda: JobStore.job_status(self, job_id, now),
                     lambda: read_job_status(self.raw_url, job_id, now), unknown_job=None)

    def list_jobs(self, limit: int = 20, now: datetime | None = None) -> list[JobStatus]:
        now = now or datetime.now(timezone.utc)
        return agree(lambda: JobStore.list_jobs(self, limit, now), lambda: read_recent_jobs(self.raw_url, limit, now))

    def latest_job_id(self, status: str | None = None) -> str | None:
        def direct() -> str | None:
            ids = read_latest_job_ids(self.raw_url, status, 1)
            assert ids is not None, "the direct path declined"
            return ids[0] if ids else None

        return agree(lambda: JobStore.latest_job_id(self, status), direct)

    def job_events(self, job_id: str, limit: int = DEFAULT_EVENT_LIMIT) -> list[JobEvent]:
        return agree(lambda: JobStore.job_events(self, job_id, limit),
                     lambda: read_job_events(self.raw_url, job_id, limit), unknown_job=[])

    def job_workers(self, job_id: str) -> list[JobWorker]:
        return agree(lambda: JobStore.job_workers(self, job_id), lambda: read_job_workers(self.raw_url, job_id),
                     unknown_job=[])

    def stage_snapshots(self, job_id: str) -> list[StageSnapshot]:
        return agree(lambda: JobStore.stage_snapshots(self, job_id),
                     lambda: read_stage_snapshots(self.raw_url, job_id), unknown_job=[])

    def eval_history(self, suite: str, metric: str | None = None,
                     limit: int = DEFAULT_EVAL_LIMIT) -> list[tuple[EvalRun, list[EvalMetric]]]:
        if sqlite_file(self.raw_url) is None:  # the direct path reads SQLite files only
            return JobStore.eval_history(self, suite, metric, limit)
        # NaN != NaN: runs and metrics are compared through their repr (nan prints the same on both paths).
        return agree(lambda: JobStore.eval_history(self, suite, metric, limit),
                     lambda: read_eval_history(self.raw_url, suite, metric, limit),
                     same=lambda a, b: repr(a) == repr(b))

    def cancel_job(self, job_id: str, now: datetime | None = None) -> str:
        if self.cancel_path == "full-cancel":
            return JobStore.cancel_job(self, job_id, now)
        cancelled = cancel_job_directly(self.raw_url, job_id, now)
        if cancelled is not None:
            return cancelled
        JobStore.cancel_job(self, job_id, now)  # declined: the full store must refuse it too (StoreError)
        raise AssertionError(f"the direct path declined to cancel {job_id}, which the full store cancelled")


def agree(full: Callable[[], Answer], direct: Callable[[], Any], unknown_job: object = None,
          same: Callable[[Any, Any], bool] = lambda a, b: a == b) -> Answer:
    """`full()`'s answer, once `direct()` gave the same: the same ValueError where full refuses an argument,
    and `unknown_job` where full raises StoreError for a job it does not have (the light command then asks
    the full store, which words the error)."""
    try:
        answer = full()
    except StoreError:
        assert direct() == unknown_job
        raise
    except ValueError as refused:
        with pytest.raises(ValueError) as also:
            direct()
        assert str(also.value) == str(refused)
        raise
    found = direct()
    assert same(found, answer), f"the direct path answered {found!r}, JobStore {answer!r}"
    return answer


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres_fresh_url")


@pytest.fixture
def store(request: pytest.FixtureRequest, store_url: str):
    with TwinPathStore.open_twin(store_url, getattr(request, "param", "full-cancel")) as opened:
        yield opened
