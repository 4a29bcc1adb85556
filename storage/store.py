"""JobStore: the one interface between layerbus and its database (SQLite or PostgreSQL).

Every method is one transaction. Claims are exclusive: BEGIN IMMEDIATE on SQLite, row locks with
SKIP LOCKED on PostgreSQL, so any number of broker processes can claim from one job. Locks are always
taken items first (in id order), then the job's item counters (in job and state order), then the job
row, so concurrent claims, completions, renewals and cancels cannot deadlock. Every item state change
updates the counters in its transaction (storage/item_counts.py), so status never counts items. A
claim is a lease (storage/leases.py): its holder renews it while it works, and only a holder may
record or hand back what it holds, so an item taken over after its lease ran out is never recorded twice.
Several brokers may work one job: each has its row in job_workers (storage/job_workers.py), and exactly
one of them finalizes the job, under a hold of its own (storage/finalization.py).

JobStore is a facade: each method hands its call to the part of the store that holds it, where its full
description is. The parts share one StoreDb (storage/store_db.py):

  part                            methods
  ------------------------------  ------------------------------------------------------------------------
  submit_store.Submissions        create_job, begin_job, add_items, discard_job
  lease_store.ItemLeases          claim_items, complete_items, requeue_items, requeue_in_flight,
                                  renew_leases, job_leases, requeue_expired
  job_workers.JobWorkers          register_worker, set_worker_state, job_workers
  finalization.Finalizations      claim_finalization, job_finalization, renew_finalization, finish_finalization
  lifecycle_store.JobLifecycle    set_job_status, cancel_job, set_results_path
  report_store.JobReports         add_job_event, job_events, record_stage_snapshots, stage_snapshots
  job_reads.JobReads              job_status, list_jobs, latest_job_id, find_job_by_name, next_runnable_job,
                                  job_settings
  item_reads.ItemReads            item_results, job_items, part_outputs, sample_items
  eval_store.EvalStore            record_eval_run, finish_eval_run, eval_run, eval_runs, previous_eval_run,
                                  eval_metrics, eval_history

The reads and the cancel that the light commands make without SQLAlchemy (storage/direct_status.py,
direct_cancel.py, sqlite_evals.py) run the same statements (storage/light_sql.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine

from layerbus.storage.engine import create_tables, open_engine
from layerbus.storage.errors import StoreError
from layerbus.storage.eval_records import DEFAULT_EVAL_LIMIT, EvalMetric, EvalRun
from layerbus.storage import light_sql
from layerbus.storage.eval_store import EvalStore
from layerbus.storage.events import DEFAULT_EVENT_LIMIT
from layerbus.storage.finalization import Finalizations
from layerbus.storage.item_reads import ItemReads
from layerbus.storage.item_sample import ItemSample
from layerbus.storage.job_reads import JobReads
from layerbus.storage.job_workers import JobWorkers
from layerbus.storage.lease_store import ItemLeases
from layerbus.storage.leases import DEFAULT_LEASE_S
from layerbus.storage.lifecycle_store import JobLifecycle
from layerbus.storage.records import (ClaimedItem, Finalization, InvalidItem, ItemResult, JobEvent, JobSettings,
                                      JobStatus, JobWorker, Lease, NewItem)
from layerbus.storage.report_store import JobReports
from layerbus.storage.snapshot_records import StageSnapshot
from layerbus.storage.status_records import DocumentProgress
from layerbus.storage.store_db import StoreDb
from layerbus.storage.submit_store import Submissions


class JobStore:
    """Jobs and their items in one SQL database; open with JobStore.open(url)."""

    def __init__(self, engine: Engine, url: str) -> None:
        self._db = StoreDb(engine, url)
        # The URL with its password masked, for messages.
        self.url = self._db.url
        self._submissions = Submissions(self._db)
        self._leases = ItemLeases(self._db)
        self._workers = JobWorkers(self._db)
        self._finalizations = Finalizations(self._db)
        self._lifecycle = JobLifecycle(self._db)
        self._reports = JobReports(self._db)
        self._jobs = JobReads(self._db)
        self._items = ItemReads(self._db)
        self._evals = EvalStore(self._db)

    @classmethod
    def open(cls, url: str) -> JobStore:
        """Connect to `url` and create the tables if needed; StoreError says what is wrong with a bad URL."""
        engine = open_engine(url)
        try:
            create_tables(engine, url)
        except StoreError:
            engine.dispose()
            raise
        return cls(engine, url)

    @property
    def db(self) -> StoreDb:
        """The database the store's parts share, for the API server's own part (storage/api_store.py)."""
        return self._db

    def close(self) -> None:
        self._db.engine.dispose()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- submitting (storage/submit_store.py) ------------------------------------------------------

    def create_job(self, settings: JobSettings, items: Sequence[NewItem], invalid_items: Sequence[InvalidItem] = (),
                   now: datetime | None = None) -> str:
        """Store a job and all its items, queued, in one transaction; returns the new job id."""
        return self._submissions.create_job(settings, items, invalid_items, now)

    def begin_job(self, settings: JobSettings, now: datetime | None = None) -> str:
        """Store a new job as validating, with no items yet (add_items fills it); returns its id."""
        return self._submissions.begin_job(settings, now)

    def add_items(self, job_id: str, items: Sequence[NewItem], invalid_items: Sequence[InvalidItem] = (),
                  now: datetime | None = None) -> None:
        """Add items to a validating job in one transaction: valid ones queued, invalid ones failed."""
        self._submissions.add_items(job_id, items, invalid_items, now)

    def discard_job(self, job_id: str) -> None:
        """Delete a validating job with its items."""
        self._submissions.discard_job(job_id)

    # --- claims and leases (storage/lease_store.py) ------------------------------------------------

    def claim_items(self, job_id: str, worker: str, limit: int, now: datetime | None = None,
                    lease_s: float = DEFAULT_LEASE_S) -> list[ClaimedItem]:
        """Lease up to `limit` queued items (in seq order) to `worker` until `now + lease_s`."""
        return self._leases.claim_items(job_id, worker, limit, now, lease_s)

    def complete_items(self, results: Sequence[ItemResult], now: datetime | None = None,
                       holder: str | None = None) -> list[int]:
        """Record results of in_progress items (`holder`'s only, if given); returns the ids written."""
        return self._leases.complete_items(results, now, holder)

    def requeue_items(self, item_ids: Iterable[int], now: datetime | None = None,
                      holder: str | None = None) -> list[int]:
        """Move in_progress items (`holder`'s only, if given) back to queued; returns the ids requeued."""
        return self._leases.requeue_items(item_ids, now, holder)

    def requeue_in_flight(self, job_id: str, now: datetime | None = None) -> int:
        """Requeue every in_progress item of a job whoever holds it; returns how many."""
        return self._leases.requeue_in_flight(job_id, now)

    def renew_leases(self, job_id: str, holder: str, lease_s: float = DEFAULT_LEASE_S,
                     now: datetime | None = None) -> int:
        """Push the lease of every item `holder` has in flight in the job to `now + lease_s`; how many."""
        return self._leases.renew_leases(job_id, holder, lease_s, now)

    def job_leases(self, job_id: str) -> list[Lease]:
        """Who holds the job's in-flight items, how many each, and when the first of their leases runs out."""
        return self._leases.job_leases(job_id)

    def requeue_expired(self, job_id: str, now: datetime | None = None, holders: Sequence[str] = (),
                        keep: str | None = None) -> dict[str, int]:
        """Requeue the job's in-flight items nobody holds any more (and `holders`'), but `keep`'s; per holder."""
        return self._leases.requeue_expired(job_id, now, holders, keep)

    # --- workers (storage/job_workers.py) ----------------------------------------------------------

    def register_worker(self, job_id: str, worker: str, host: str, chain: str | None = None,
                        lease_s: float = DEFAULT_LEASE_S, now: datetime | None = None) -> None:
        """Record that `worker` ("host:pid:token") works the job; `layerbus status JOB` lists it."""
        self._workers.register_worker(job_id, worker, host, chain, lease_s, now)

    def set_worker_state(self, job_id: str, worker: str, state: str, now: datetime | None = None) -> None:
        """Set `worker`'s state on the job (working, finalizing, stopped) and stamp its last renewal."""
        self._workers.set_worker_state(job_id, worker, state, now)

    def job_workers(self, job_id: str) -> list[JobWorker]:
        """The brokers that worked the job, in the order they started."""
        return self._workers.job_workers(job_id)

    # --- finalization (storage/finalization.py) ----------------------------------------------------

    def claim_finalization(self, job_id: str, worker: str, lease_s: float = DEFAULT_LEASE_S,
                           gone: Sequence[str] = (), now: datetime | None = None) -> Finalization:
        """Make `worker` the one broker that finalizes the job, if it is due and nobody else holds it."""
        return self._finalizations.claim_finalization(job_id, worker, lease_s, gone, now)

    def job_finalization(self, job_id: str) -> Finalization:
        """Who finalizes (or finalized) the job and until when its hold runs; `claimed` is always False."""
        return self._finalizations.job_finalization(job_id)

    def renew_finalization(self, job_id: str, worker: str, lease_s: float = DEFAULT_LEASE_S,
                           now: datetime | None = None) -> bool:
        """Push `worker`'s hold on the job's finalization to `now + lease_s`; False when it holds none."""
        return self._finalizations.renew_finalization(job_id, worker, lease_s, now)

    def finish_finalization(self, job_id: str, worker: str, results_path: str | Path, status: str | None,
                            error: str | None = None, now: datetime | None = None) -> bool:
        """Record the results file `worker` wrote and end the job; False when `worker` no longer holds it."""
        return self._finalizations.finish_finalization(job_id, worker, results_path, status, error, now)

    # --- job lifecycle (storage/lifecycle_store.py) ------------------------------------------------

    def set_job_status(self, job_id: str, status: str, error: str | None = None, now: datetime | None = None) -> None:
        """Move a job to `status`, stamping `<status>_at`; StoreError if the lifecycle forbids the move."""
        self._lifecycle.set_job_status(job_id, status, error, now)

    def cancel_job(self, job_id: str, now: datetime | None = None) -> str:
        """Cancel a job's queued items and return its new status: cancelled, or cancelling while items are in
        flight."""
        return self._lifecycle.cancel_job(job_id, now)

    def set_results_path(self, job_id: str, path: str | Path) -> None:
        self._lifecycle.set_results_path(job_id, path)

    # --- events and stage snapshots (storage/report_store.py) --------------------------------------

    def add_job_event(self, job_id: str, kind: str, message: str, duration_s: float | None = None,
                      now: datetime | None = None) -> None:
        """Record what happened to a job (kind e.g. stage_lost, recovered) for `layerbus status`."""
        self._reports.add_job_event(job_id, kind, message, duration_s, now)

    def job_events(self, job_id: str, limit: int = DEFAULT_EVENT_LIMIT) -> list[JobEvent]:
        """The job's last `limit` events, oldest first."""
        return self._reports.job_events(job_id, limit)

    def record_stage_snapshots(self, job_id: str, broker: str, snapshots: Sequence[StageSnapshot],
                               now: datetime | None = None) -> None:
        """Replace `broker`'s stage snapshots of the job with `snapshots`, stamped `now` (`layerbus top`)."""
        self._reports.record_stage_snapshots(job_id, broker, snapshots, now)

    def stage_snapshots(self, job_id: str) -> list[StageSnapshot]:
        """Every broker's latest view of the job's stages, by broker, then in chain order."""
        return self._reports.stage_snapshots(job_id)

    # --- reading jobs (storage/job_reads.py) -------------------------------------------------------

    def job_status(self, job_id: str, now: datetime | None = None) -> JobStatus:
        """State, counts, throughput and ETA of one job (two queries, neither reading items)."""
        return self._jobs.job_status(job_id, now)

    def list_jobs(self, limit: int = 20, now: datetime | None = None) -> list[JobStatus]:
        """The `limit` most recently created jobs, newest first."""
        return self._jobs.list_jobs(limit, now)

    def latest_job_id(self, status: str | None = None) -> str | None:
        """The newest job (created_at, then id), or the newest in `status`; None when there is none."""
        return self._jobs.latest_job_id(status)

    def find_job_by_name(self, name: str) -> str | None:
        """The newest job named `name` (created_at, then id), or None."""
        return self._jobs.find_job_by_name(name)

    def next_runnable_job(self) -> str | None:
        """The oldest job with work to hand out (queued or in_progress), or None."""
        return self._jobs.next_runnable_job()

    def job_settings(self, job_id: str) -> JobSettings:
        return self._jobs.job_settings(job_id)

    # --- reading items (storage/item_reads.py) -----------------------------------------------------

    def item_results(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Finished items of a job in seq order, as result rows (one per sample), read in pages."""
        return self._items.item_results(job_id)

    def job_items(self, job_id: str) -> Iterator[NewItem]:
        """Every item of a job as it was queued, in seq order, read in pages."""
        return self._items.job_items(job_id)

    def document_progress(self, job_id: str) -> DocumentProgress | None:
        """How far the job's long documents are (storage/light_sql.py); None when it split none."""
        with self._read() as conn:
            return light_sql.document_progress(self._db.statements(conn), job_id)

    def part_outputs(self, job_id: str, parent_id: str) -> list[str]:
        """The outputs of a long document's item's parts, in order: what its reduce prompt is made from."""
        return self._items.part_outputs(job_id, parent_id)

    def sample_items(self, job_id: str, count: int) -> ItemSample:
        """At most `count` items of a job as it was queued, spread evenly over it, and how many it has."""
        return self._items.sample_items(job_id, count)

    # --- eval runs (storage/eval_store.py) ---------------------------------------------------------

    def record_eval_run(self, run: EvalRun) -> None:
        """Record that job `run.job_id` is an eval run; StoreError if the job is missing or already has a run."""
        self._evals.record_eval_run(run)

    def finish_eval_run(self, job_id: str, samples_path: str | Path | None, results_path: str | Path | None,
                        metrics: Sequence[EvalMetric], now: datetime | None = None) -> None:
        """Set the run's paths and finished_at and replace all its metric rows with `metrics`, atomically."""
        self._evals.finish_eval_run(job_id, samples_path, results_path, metrics, now)

    def eval_run(self, job_id: str) -> EvalRun:
        """The eval run of job `job_id`; StoreError naming the job when it has none."""
        return self._evals.eval_run(job_id)

    def eval_runs(self, suite: str | None = None, limit: int = DEFAULT_EVAL_LIMIT, *,
                  include_unfinished: bool = False) -> list[EvalRun]:
        """The `limit` newest finished runs (of one suite unless None), with unfinished ones if asked."""
        return self._evals.eval_runs(suite, limit, include_unfinished)

    def previous_eval_run(self, suite: str, before_job_id: str) -> EvalRun | None:
        """The latest finished run of `suite` created before run `before_job_id`, or None."""
        return self._evals.previous_eval_run(suite, before_job_id)

    def eval_metrics(self, job_id: str) -> list[EvalMetric]:
        """The run's metrics ordered by task, metric, filter ([] until finished)."""
        return self._evals.eval_metrics(job_id)

    def eval_history(self, suite: str, metric: str | None = None,
                     limit: int = DEFAULT_EVAL_LIMIT) -> list[tuple[EvalRun, list[EvalMetric]]]:
        """The suite's last `limit` finished runs, oldest first, each with its metrics (only `metric`'s, if given)."""
        return self._evals.eval_history(suite, metric, limit)

    # --- raw access, for tests that read the columns beneath the answers ----------------------------

    def _read(self) -> AbstractContextManager[Connection]:
        return self._db.read()
