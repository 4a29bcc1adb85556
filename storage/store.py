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
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Select, bindparam, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from layerbus.storage.engine import READ_ONLY_OPTION, create_tables, open_engine
from layerbus.storage.errors import StoreError, mask_url
from layerbus.storage.eval_records import DEFAULT_EVAL_LIMIT, EvalMetric, EvalRun
from layerbus.storage.eval_store import EvalTables
from layerbus.storage.events import DEFAULT_EVENT_LIMIT, event_row, events_oldest_first
from layerbus.storage.item_counts import CountChanges, insert_counts, lock_counts, read_counts
from layerbus.storage.item_sample import ItemSample, sample_query
from layerbus.storage import finalization
from layerbus.storage import job_workers as workers
from layerbus.storage.leases import DEFAULT_LEASE_S, held_by, job_leases, lease_end, reclaimable
from layerbus.storage.records import (ClaimedItem, Finalization, InvalidItem, ItemResult, JobEvent, JobSettings,
                                      JobStatus, JobWorker, Lease, NewItem)
from layerbus.storage.result_row import RESULT_COLUMNS, expand_samples
from layerbus.storage.snapshot_records import (MAX_BROKER_CHARS, StageSnapshot, snapshot_from_row, snapshot_order,
                                               snapshot_row)
from layerbus.storage.rows import (claimed_item, duplicate_message, insert_new_items, invalid_item_row, new_item_row,
                                   result_params)
from layerbus.storage.schema import item_counts as counts_table
from layerbus.storage.schema import items as items_table
from layerbus.storage.schema import job_events as events_table
from layerbus.storage.schema import stage_snapshots as snapshots_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.signal_guard import guarded
from layerbus.storage.states import (
    CANCELLABLE_JOB_STATES,
    FINISHED_ITEM_STATES,
    RUNNABLE_JOB_STATES,
    check_finish_reason,
    check_job_transition,
    timestamp_column,
)
from layerbus.storage.status import StateAggregate, build_job_status

# Column collections, to keep query expressions short.
ITEM = items_table.c
JOB = jobs_table.c
COUNT = counts_table.c
EVENT = events_table.c
SNAPSHOT = snapshots_table.c
# Rows per page when streaming results, and ids per IN (...) list (SQLite allows 32,766 parameters).
_PAGE = 1000


def _utc(now: datetime | None) -> datetime:
    """The injected clock reading, or the real one; naive times are refused (local? UTC?)."""
    if now is None:
        return datetime.now(timezone.utc)
    if now.tzinfo is None:
        raise ValueError(
            f"naive datetime {now.isoformat()} given to the job store: "
            "pass an aware one, e.g. datetime.now(timezone.utc)"
        )
    return now


def new_job_id() -> str:
    return "job_" + secrets.token_hex(6)


class JobStore:
    """Jobs and their items in one SQL database; open with JobStore.open(url)."""

    def __init__(self, engine: Engine, url: str) -> None:
        self._engine = engine
        self._read_engine = engine.execution_options(**{READ_ONLY_OPTION: True})
        # Only PostgreSQL needs (and understands) row locks; SQLite's BEGIN IMMEDIATE locks the database.
        self._row_locks = engine.dialect.name == "postgresql"
        # PostgreSQL's text columns cannot hold a NUL character; a generated one is stored as U+FFFD there.
        self._no_nul = engine.dialect.name == "postgresql"
        # The URL with its password masked, for messages.
        self.url = mask_url(url)
        # The eval queries (storage/eval_store.py); each eval method below is one transaction around one of them.
        self._evals = EvalTables(self.url, self._row_locks)

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

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- submitting -------------------------------------------------------------------------------

    def create_job(
        self,
        settings: JobSettings,
        items: Sequence[NewItem],
        invalid_items: Sequence[InvalidItem] = (),
        now: datetime | None = None,
    ) -> str:
        """Store a job and all its items in one transaction, queued; returns the new job id.

        Validation happens before (in jobs/), so the job is stored already past validating; both
        created_at and queued_at are stamped. Invalid items are stored as failed, finish_reason 'error'.
        """
        now = _utc(now)
        job_id = new_job_id()
        rows = [new_item_row(job_id, item) for item in items]
        rows += [invalid_item_row(job_id, item, now) for item in invalid_items]
        job_row = {
            "id": job_id, "name": settings.name, "task": settings.task, "model": settings.model,
            "settings_json": settings.to_json(), "input_path": settings.input_path, "results_path": None,
            "status": "queued", "total_count": len(rows), "error": None, "created_at": now, "queued_at": now,
        }  # fmt: skip
        try:
            with self._write() as conn:
                conn.execute(insert(jobs_table), job_row)
                if rows:
                    conn.execute(insert(items_table), rows)
                insert_counts(conn, job_id, [StateAggregate("queued", len(items), 0, 0, 0),
                                             StateAggregate("failed", len(invalid_items), 0, 0, 0)])
        except IntegrityError as exc:
            raise StoreError(duplicate_message(rows, exc)) from exc
        return job_id

    def begin_job(self, settings: JobSettings, now: datetime | None = None) -> str:
        """Store a new job as validating, with no items yet; returns its id.

        For inputs too large to hold: add_items fills it a chunk at a time, set_job_status(job_id, "queued")
        makes it runnable once the whole input passed, discard_job removes it when it did not. No broker
        claims from a validating job, so nothing of it runs before it is queued.
        """
        job_id = new_job_id()
        job_row = {
            "id": job_id, "name": settings.name, "task": settings.task, "model": settings.model,
            "settings_json": settings.to_json(), "input_path": settings.input_path, "results_path": None,
            "status": "validating", "total_count": 0, "error": None, "created_at": _utc(now),
        }  # fmt: skip
        with self._write() as conn:
            conn.execute(insert(jobs_table), job_row)
            insert_counts(conn, job_id, [])
        return job_id

    def add_items(self, job_id: str, items: Sequence[NewItem], invalid_items: Sequence[InvalidItem] = (),
                  now: datetime | None = None) -> None:
        """Add items to a validating job (begin_job) in one transaction: valid ones queued, invalid ones failed."""
        now = _utc(now)
        rows = [invalid_item_row(job_id, item, now) for item in invalid_items]
        try:
            with self._write() as conn:
                status = self._job_field(conn, job_id, JOB.status)
                if status != "validating":
                    raise StoreError(f"job {job_id!r} is {status}: items are added only while it is validating")
                if items:
                    insert_new_items(conn, job_id, items)
                if rows:
                    conn.execute(insert(items_table), rows)
                changes = CountChanges()
                changes.add(job_id, "queued", len(items), 0)
                changes.add(job_id, "failed", len(invalid_items), 0)
                changes.apply(conn)
                added = len(items) + len(rows)
                conn.execute(update(jobs_table).where(JOB.id == job_id).values(total_count=JOB.total_count + added))
        except IntegrityError as exc:
            raise StoreError(duplicate_message([new_item_row(job_id, item) for item in items] + rows, exc)) from exc

    def discard_job(self, job_id: str) -> None:
        """Delete a validating job with its items: a refused input leaves nothing behind."""
        with self._write() as conn:
            status = self._job_field(conn, job_id, JOB.status)
            if status != "validating":
                raise StoreError(f"job {job_id!r} is {status}: only a validating job can be discarded")
            for table in (items_table, counts_table):  # its rows first: SQLite enforces the cascade only when asked
                conn.execute(delete(table).where(table.c.job_id == job_id))
            conn.execute(delete(jobs_table).where(JOB.id == job_id))

    # --- running ----------------------------------------------------------------------------------

    def claim_items(self, job_id: str, worker: str, limit: int, now: datetime | None = None,
                    lease_s: float = DEFAULT_LEASE_S) -> list[ClaimedItem]:
        """Move up to `limit` queued items (in seq order) to in_progress for `worker`, leased until
        `now + lease_s` (renew_leases pushes that on); [] when none are left.

        The first claim moves the job from queued to in_progress, even when it hands out nothing: a job
        whose items were all refused at submit still goes in_progress -> finalizing like any other.
        Jobs that are not queued or in_progress (cancelling, finalizing, ...) hand out nothing.
        """
        if limit < 1:
            raise ValueError(f"claim_items needs limit >= 1, got {limit=}")
        now = _utc(now)
        expires = lease_end(now, lease_s)
        with self._write() as conn:
            job_status = self._job_field(conn, job_id, JOB.status)
            if job_status not in RUNNABLE_JOB_STATES:
                return []
            query = (
                select(ITEM.id, ITEM.custom_id, ITEM.seq, ITEM.input, ITEM.prompt, ITEM.params_json, ITEM.attempts)
                .where(ITEM.job_id == job_id, ITEM.status == "queued")
                .order_by(ITEM.seq)
                .limit(limit)
            )
            rows = conn.execute(self._locking(query, skip_locked=True)).all()
            if rows:
                conn.execute(
                    update(items_table)
                    .where(ITEM.id.in_([r.id for r in rows]))
                    .values(status="in_progress", attempts=ITEM.attempts + 1, claimed_by=worker, claimed_at=now,
                            lease_expires_at=expires)
                )
                changes = CountChanges()
                changes.add(job_id, "queued", -len(rows), -sum(1 for r in rows if r.attempts > 0))
                changes.add(job_id, "in_progress", len(rows), len(rows))
                changes.apply(conn)
            if job_status == "queued":
                conn.execute(
                    update(jobs_table)
                    .where(JOB.id == job_id, JOB.status == "queued")
                    .values(status="in_progress", in_progress_at=now)
                )
        return [claimed_item(job_id, row) for row in rows]

    def complete_items(self, results: Sequence[ItemResult], now: datetime | None = None,
                       holder: str | None = None) -> list[int]:
        """Record results of in_progress items (failed when error is set); returns the ids written.

        Items no longer in_progress (already finished, cancelled, requeued) are skipped, so a late
        duplicate result never overwrites a final one; with `holder`, so are items it no longer holds
        (its lease ran out and another worker claimed them). Within `results`, the first result for an id wins.
        """
        now = _utc(now)
        first: dict[int, ItemResult] = {}
        for result in results:
            check_finish_reason(result.item_id, result.finish_reason)
            first.setdefault(result.item_id, result)
        written: set[int] = set()
        changes = CountChanges()
        done_by_job: dict[str, tuple[int, int]] = {}  # job_id -> (items, generated tokens) recorded
        with self._write() as conn:
            for chunk in _chunks(list(first)):
                live = self._lock_in_progress(conn, _holding(ITEM.id.in_(chunk), holder))
                if not live:
                    continue
                conn.execute(
                    update(items_table)
                    .where(ITEM.id == bindparam("b_id"), ITEM.status == "in_progress")
                    .values(
                        status=bindparam("b_status"), output=bindparam("b_output"),
                        finish_reason=bindparam("b_finish_reason"), prompt_tokens=bindparam("b_prompt_tokens"),
                        completion_tokens=bindparam("b_completion_tokens"), latency_s=bindparam("b_latency_s"),
                        error=bindparam("b_error"), logprobs=bindparam("b_logprobs"),
                        samples=bindparam("b_samples"), finished_at=now,
                        lease_expires_at=None,
                    ),  # fmt: skip
                    [result_params(first[item_id], no_nul=self._no_nul) for item_id, _ in live],
                )
                written.update(item_id for item_id, _ in live)
                for item_id, job_id in live:
                    result = first[item_id]
                    changes.add(job_id, "in_progress", -1, -1)
                    changes.add(job_id, result.status, 1, 1, result.prompt_tokens, result.completion_tokens)
                    items, tokens = done_by_job.get(job_id, (0, 0))
                    done_by_job[job_id] = (items + 1, tokens + (result.completion_tokens or 0))
            jobs = {job_id for job_id, _ in changes.deltas}
            changes.apply(conn)
            if holder is not None:  # the worker's own tally, for `layerbus status JOB`'s workers
                workers.count_done(conn, holder, done_by_job)
            self._settle_cancelling(conn, jobs, now)
        return [item_id for item_id in first if item_id in written]

    def requeue_items(self, item_ids: Iterable[int], now: datetime | None = None,
                      holder: str | None = None) -> list[int]:
        """Move in_progress items back to queued (for a retry); returns the ids requeued.

        Items of a cancelling job are cancelled instead, and the job becomes cancelled once nothing
        of it is in flight. Items not in_progress, and with `holder` items it does not hold, are left alone.
        """
        now = _utc(now)
        with self._write() as conn:
            live: list[tuple[int, str]] = []
            for chunk in _chunks(list(dict.fromkeys(item_ids))):
                live += self._lock_in_progress(conn, _holding(ITEM.id.in_(chunk), holder))
            return self._requeue(conn, live, now)

    def requeue_in_flight(self, job_id: str, now: datetime | None = None) -> int:
        """Requeue every in_progress item of a job whoever holds it; returns how many were requeued.

        Only for when every worker of the job is known to be gone: a live holder's results would then be
        refused. Brokers requeue with requeue_expired, which takes only what nobody holds any more.
        """
        now = _utc(now)
        with self._write() as conn:
            self._job_field(conn, job_id, JOB.status)
            live = self._lock_in_progress(conn, ITEM.job_id == job_id)
            return len(self._requeue(conn, live, now))

    # --- leases -----------------------------------------------------------------------------------

    def renew_leases(self, job_id: str, holder: str, lease_s: float = DEFAULT_LEASE_S,
                     now: datetime | None = None) -> int:
        """Push the lease of every item `holder` has in flight in the job to `now + lease_s`; how many.

        An item whose lease ran out but which nobody requeued yet is still the holder's, and is renewed.
        """
        now = _utc(now)
        expires = lease_end(now, lease_s)
        with self._write() as conn:
            self._job_field(conn, job_id, JOB.id)
            held = [item_id for item_id, _ in self._lock_in_progress(conn, (ITEM.job_id == job_id) & held_by(holder))]
            for chunk in _chunks(held):
                conn.execute(update(items_table).where(ITEM.id.in_(chunk)).values(lease_expires_at=expires))
            workers.stamp(conn, job_id, holder, now)  # its last renewal, for `layerbus status JOB`
        return len(held)

    def job_leases(self, job_id: str) -> list[Lease]:
        """Who holds the job's in-flight items, how many each, and when the first of their leases runs out."""
        with self._read() as conn:
            self._job_field(conn, job_id, JOB.id)
            return job_leases(conn, job_id)

    def requeue_expired(self, job_id: str, now: datetime | None = None, holders: Sequence[str] = (),
                        keep: str | None = None) -> dict[str, int]:
        """Requeue the job's in-flight items whose lease ran out by `now` (or that have none), and those of
        `holders` (workers known to be gone), except those `keep` holds; how many per holder.

        Items of a cancelling job are cancelled instead (not counted), as requeue_items does.
        """
        now = _utc(now)
        with self._write() as conn:
            self._job_field(conn, job_id, JOB.id)
            condition = (ITEM.job_id == job_id) & reclaimable(now, holders)
            if keep is not None:
                condition &= ITEM.claimed_by.is_distinct_from(keep)
            query = select(ITEM.id, ITEM.claimed_by).where(condition, ITEM.status == "in_progress").order_by(ITEM.id)
            found = conn.execute(self._locking(query)).all()
            requeued = set(self._requeue(conn, [(row.id, job_id) for row in found], now))
        counts: dict[str, int] = {}
        for row in found:
            if row.id in requeued:
                counts[row.claimed_by or ""] = counts.get(row.claimed_by or "", 0) + 1
        return counts

    # --- workers and finalization (several brokers, one job) ---------------------------------------

    def register_worker(self, job_id: str, worker: str, host: str, chain: str | None = None,
                        lease_s: float = DEFAULT_LEASE_S, now: datetime | None = None) -> None:
        """Record that `worker` ("host:pid:token") works the job, on `host`, with `chain` (its stages in
        text form), renewing every lease within `lease_s`; `layerbus status JOB` lists it."""
        now = _utc(now)
        with self._write() as conn:
            self._job_field(conn, job_id, JOB.id)
            workers.register(conn, job_id, worker, host, chain, lease_s, now)

    def set_worker_state(self, job_id: str, worker: str, state: str, now: datetime | None = None) -> None:
        """Set `worker`'s state on the job (working, finalizing, stopped) and stamp its last renewal."""
        now = _utc(now)
        with self._write() as conn:
            workers.stamp(conn, job_id, worker, now, state)

    def job_workers(self, job_id: str) -> list[JobWorker]:
        """The brokers that worked the job, in the order they started."""
        with self._read() as conn:
            self._job_field(conn, job_id, JOB.id)
            return workers.job_workers(conn, job_id)

    def claim_finalization(self, job_id: str, worker: str, lease_s: float = DEFAULT_LEASE_S,
                           gone: Sequence[str] = (), now: datetime | None = None) -> Finalization:
        """Make `worker` the one broker that finalizes the job, if it is due and nobody else holds it.

        Due: the job is in_progress with nothing queued or in flight (the claim moves it to finalizing), or
        finalizing, or cancelled without its results file. Held: by another worker whose hold has not run
        out (`now + lease_s` from its claim or last renew_finalization) and who is not in `gone` (workers
        known to have exited). The answer says who holds it either way (storage/finalization.py).
        """
        now = _utc(now)
        with self._write() as conn:
            return finalization.claim(conn, job_id, worker, now, lease_s, gone, self._locking)

    def job_finalization(self, job_id: str) -> Finalization:
        """Who finalizes (or finalized) the job and until when its hold runs; `claimed` is always False."""
        with self._read() as conn:
            return finalization.read(conn, job_id)

    def renew_finalization(self, job_id: str, worker: str, lease_s: float = DEFAULT_LEASE_S,
                           now: datetime | None = None) -> bool:
        """Push `worker`'s hold on the job's finalization to `now + lease_s`; False when it holds none."""
        now = _utc(now)
        with self._write() as conn:
            held = finalization.renew(conn, job_id, worker, now, lease_s)
            if held:
                workers.stamp(conn, job_id, worker, now)
            return held

    def finish_finalization(self, job_id: str, worker: str, results_path: str | Path, status: str | None,
                            error: str | None = None, now: datetime | None = None) -> bool:
        """Record the results file `worker` wrote and move the job to `status` (completed or failed; None
        for a cancelled job, which stays cancelled), releasing the hold; False, changing nothing, when
        `worker` no longer holds the finalization (its hold ran out and another broker took it over)."""
        now = _utc(now)
        with self._write() as conn:
            return finalization.finish(conn, job_id, worker, str(results_path), status, error, now, self._locking)

    # --- job lifecycle ----------------------------------------------------------------------------

    def set_job_status(self, job_id: str, status: str, error: str | None = None, now: datetime | None = None) -> None:
        """Move a job to `status`, stamping `<status>_at`; StoreError if the lifecycle forbids the move."""
        now = _utc(now)
        with self._write() as conn:
            query = select(JOB.status).where(JOB.id == job_id)
            current = conn.execute(self._locking(query)).scalar_one_or_none()
            if current is None:
                raise self._no_job(job_id)
            check_job_transition(job_id, current, status)
            values: dict[str, Any] = {"status": status, timestamp_column(status): now}
            if error is not None:
                values["error"] = error
            conn.execute(update(jobs_table).where(JOB.id == job_id).values(**values))

    def cancel_job(self, job_id: str, now: datetime | None = None) -> str:
        """Cancel a job's queued items and return the job's new status.

        The job becomes cancelled at once when nothing is in flight, otherwise cancelling until its
        in-flight items finish or are requeued. Finished outputs stay. Cancelling twice is harmless.
        The queued items' rows keep status queued: the job's cancelling_at makes them cancelled for
        claims, counts and results alike (storage/item_counts.py), so a cancel costs the same at any size.
        """
        now = _utc(now)
        with self._write() as conn:
            current = self._job_field(conn, job_id, JOB.status)
            if current in ("cancelling", "cancelled"):
                return current
            if current not in CANCELLABLE_JOB_STATES:
                raise StoreError(
                    f"job {job_id!r} is {current}: only {', '.join(CANCELLABLE_JOB_STATES)} jobs can be cancelled"
                )
            # The queued items' rows and their counter stay as they are: cancelling_at marks them
            # cancelled (status.reported_aggregates, _result_pages), which takes one
            # statement whatever the job's size. Locking the counters waits out concurrent completions
            # and requeues, so the in-flight count is final.
            counts = lock_counts(conn, job_id, self._row_locks)
            in_flight = counts["in_progress"].count
            target = "cancelling" if in_flight else "cancelled"
            moved = conn.execute(
                update(jobs_table)
                .where(JOB.id == job_id, JOB.status == current)
                .values(status=target, cancelling_at=now, **({"cancelled_at": now} if target == "cancelled" else {}))
            )
            if moved.rowcount != 1:
                raise StoreError(f"job {job_id!r} changed state while being cancelled; run the cancel again")
        return target

    def set_results_path(self, job_id: str, path: str | Path) -> None:
        with self._write() as conn:
            self._job_field(conn, job_id, JOB.id)
            conn.execute(update(jobs_table).where(JOB.id == job_id).values(results_path=str(path)))

    def add_job_event(
        self, job_id: str, kind: str, message: str, duration_s: float | None = None, now: datetime | None = None
    ) -> None:
        """Record what happened to a job (kind e.g. stage_lost, recovered) for `layerbus status`.

        Messages beyond storage.events.MAX_EVENT_MESSAGE_CHARS are cut; duration_s is how long it took, if a span.
        """
        row = event_row(job_id, kind, message, duration_s, _utc(now))
        with self._write() as conn:
            self._job_field(conn, job_id, JOB.id)
            conn.execute(insert(events_table), row)

    def record_stage_snapshots(self, job_id: str, broker: str, snapshots: Sequence[StageSnapshot],
                               now: datetime | None = None) -> None:
        """Replace `broker`'s stage snapshots of the job with `snapshots`, stamped `now` (`layerbus top`).

        One short transaction: the broker's earlier rows go, so a stage it no longer knows leaves the view.
        """
        now = _utc(now)
        rows = [snapshot_row(job_id, broker, snapshot, now) for snapshot in snapshots]
        with self._write() as conn:
            self._job_field(conn, job_id, JOB.id)
            conn.execute(delete(snapshots_table).where(SNAPSHOT.job_id == job_id,
                                                       SNAPSHOT.broker == broker[:MAX_BROKER_CHARS]))
            if rows:
                conn.execute(insert(snapshots_table), rows)

    # --- reading ----------------------------------------------------------------------------------

    def job_status(self, job_id: str, now: datetime | None = None) -> JobStatus:
        """State, counts, throughput and ETA of one job (two queries, neither reading items)."""
        with self._read() as conn:
            job = conn.execute(select(jobs_table).where(JOB.id == job_id)).mappings().one_or_none()
            if job is None:
                raise self._no_job(job_id)
            aggregates = read_counts(conn, [job_id])
        return build_job_status(job, aggregates.get(job_id, []), _utc(now))

    def list_jobs(self, limit: int = 20, now: datetime | None = None) -> list[JobStatus]:
        """The `limit` most recently created jobs, newest first."""
        with self._read() as conn:
            rows = conn.execute(
                select(jobs_table).order_by(JOB.created_at.desc(), JOB.id.desc()).limit(limit)
            ).mappings().all()
            aggregates = read_counts(conn, [r["id"] for r in rows])
        return [build_job_status(r, aggregates.get(r["id"], []), _utc(now)) for r in rows]

    def job_events(self, job_id: str, limit: int = DEFAULT_EVENT_LIMIT) -> list[JobEvent]:
        """The job's last `limit` events, oldest first."""
        if limit < 1:
            raise ValueError(f"job_events needs limit >= 1, got {limit=}")
        with self._read() as conn:
            self._job_field(conn, job_id, JOB.id)
            query = (
                select(EVENT.at, EVENT.kind, EVENT.message, EVENT.duration_s)
                .where(EVENT.job_id == job_id)
                .order_by(EVENT.id.desc())
                .limit(limit)
            )
            return events_oldest_first(conn.execute(query))

    def latest_job_id(self, status: str | None = None) -> str | None:
        """The newest job (created_at, then id), or the newest in `status`; None when there is none."""
        with self._read() as conn:
            query = select(JOB.id).order_by(JOB.created_at.desc(), JOB.id.desc()).limit(1)
            if status is not None:
                query = query.where(JOB.status == status)
            return conn.execute(query).scalar_one_or_none()

    def stage_snapshots(self, job_id: str) -> list[StageSnapshot]:
        """Every broker's latest view of the job's stages, by broker, then in chain order (snapshot_order)."""
        with self._read() as conn:
            self._job_field(conn, job_id, JOB.id)
            rows = conn.execute(select(snapshots_table).where(SNAPSHOT.job_id == job_id)).mappings().all()
        return sorted((snapshot_from_row(row) for row in rows), key=snapshot_order)

    def find_job_by_name(self, name: str) -> str | None:
        """The newest job named `name` (created_at, then id), or None: how a caller that names its jobs by
        what they compute (lm-eval's adapter: a digest of model and items) finds its earlier run to resume."""
        if not name:
            raise ValueError("find_job_by_name needs a non-empty name: unnamed jobs all share the name ''")
        with self._read() as conn:
            query = select(JOB.id).where(JOB.name == name).order_by(JOB.created_at.desc(), JOB.id.desc()).limit(1)
            return conn.execute(query).scalar_one_or_none()

    def next_runnable_job(self) -> str | None:
        """The oldest job with work to hand out (queued or in_progress), or None."""
        with self._read() as conn:
            query = (
                select(JOB.id)
                .where(JOB.status.in_(RUNNABLE_JOB_STATES))
                .order_by(JOB.created_at, JOB.id)
                .limit(1)
            )
            return conn.execute(query).scalar_one_or_none()

    def job_settings(self, job_id: str) -> JobSettings:
        with self._read() as conn:
            return JobSettings.from_json(self._job_field(conn, job_id, JOB.settings_json))

    def item_results(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Finished items (completed, failed, cancelled) of a job in seq order, as result rows.

        Keys: custom_id, seq, input, output, finish_reason, prompt_tokens, completion_tokens,
        latency_s, error, status, logprobs, sample_index: one row per sample of an item asked for n > 1
        samples (jobs/samples.py), each with its own output, finish_reason, completion_tokens, ... Read in pages, each its own short transaction.
        """
        with self._read() as conn:
            cancelled_at = self._job_field(conn, job_id, JOB.cancelling_at)
        return self._result_pages(job_id, cancelled=cancelled_at is not None)

    def job_items(self, job_id: str) -> Iterator[NewItem]:
        """Every item of a job as it was queued (custom_id, input, prompt, params, seq), in seq order.
        Items refused at submit have no prompt; they come back with prompt "". Read in pages."""
        with self._read() as conn:
            self._job_field(conn, job_id, JOB.id)
        last_seq: int | None = None
        while True:
            query = select(ITEM.custom_id, ITEM.input, ITEM.prompt, ITEM.params_json, ITEM.seq).where(
                ITEM.job_id == job_id)
            if last_seq is not None:
                query = query.where(ITEM.seq > last_seq)
            with self._read() as conn:
                page = conn.execute(query.order_by(ITEM.seq).limit(_PAGE)).all()
            yield from (NewItem(row.custom_id, row.input, row.prompt or "", json.loads(row.params_json), row.seq)
                        for row in page)
            if len(page) < _PAGE:
                return
            last_seq = page[-1].seq

    def sample_items(self, job_id: str, count: int) -> ItemSample:
        """At most `count` items of a job as it was queued, spread evenly over it in seq order (all of
        them when it has no more), and how many it has: what the planner reads of a job too large to
        read whole (storage/item_sample.py). Only the sampled rows' columns are read."""
        with self._read() as conn:
            total = int(self._job_field(conn, job_id, JOB.total_count))
            # Two subqueries, not min and max in one select: SQLite reads only the index's ends for a lone
            # min() or max(), and every entry of the job's for both (0.3 s for a million).
            first, last = (select(end(ITEM.seq)).where(ITEM.job_id == job_id).scalar_subquery()
                           for end in (func.min, func.max))
            seqs = conn.execute(select(first, last)).one()
            rows = conn.execute(sample_query(job_id, count, total, tuple(seqs))).all() if total else []
        return ItemSample(tuple(NewItem(row.custom_id, row.input, row.prompt or "", json.loads(row.params_json),
                                        row.seq) for row in rows), total)

    # --- eval runs ------------------------------------------------------------------------------------

    def record_eval_run(self, run: EvalRun) -> None:
        """Record that job `run.job_id` is an eval run; StoreError if the job is missing or already has a run.

        ValueError when fingerprint_hash is not the sha256 of fingerprint_json (see canonical_fingerprint),
        a JSON field is not JSON, or a time is naive.
        """
        with self._write() as conn:
            self._evals.record(conn, run)

    def finish_eval_run(
        self,
        job_id: str,
        samples_path: str | Path | None,
        results_path: str | Path | None,
        metrics: Sequence[EvalMetric],
        now: datetime | None = None,
    ) -> None:
        """Set the run's samples and results paths and finished_at, and replace all its metric rows with `metrics`.

        Atomic: finishing again (a re-finalize after a crash) leaves exactly `metrics`, nothing lost or doubled.
        NaN values are stored as NULL. StoreError when the job has no recorded eval run.
        """
        now = _utc(now)
        with self._write() as conn:
            self._evals.finish(conn, job_id, samples_path, results_path, metrics, now)

    def eval_run(self, job_id: str) -> EvalRun:
        """The eval run of job `job_id`; StoreError naming the job when it has none."""
        with self._read() as conn:
            return self._evals.run(conn, job_id)

    def eval_runs(
        self, suite: str | None = None, limit: int = DEFAULT_EVAL_LIMIT, *, include_unfinished: bool = False
    ) -> list[EvalRun]:
        """The `limit` newest finished runs (created_at, then job_id, descending), of one suite unless None.

        suite "" selects the ad-hoc runs; include_unfinished adds runs not finished (running or crashed).
        """
        with self._read() as conn:
            return self._evals.runs(conn, suite, limit, include_unfinished)

    def previous_eval_run(self, suite: str, before_job_id: str) -> EvalRun | None:
        """The latest finished run of `suite` created before run `before_job_id` (ties: lower job id), or None.

        StoreError when `before_job_id` has no recorded eval run.
        """
        with self._read() as conn:
            return self._evals.previous(conn, suite, before_job_id)

    def eval_metrics(self, job_id: str) -> list[EvalMetric]:
        """The run's metrics ordered by task, metric, filter ([] until finished); StoreError when there is no run."""
        with self._read() as conn:
            return self._evals.metrics(conn, job_id)

    def eval_history(
        self, suite: str, metric: str | None = None, limit: int = DEFAULT_EVAL_LIMIT
    ) -> list[tuple[EvalRun, list[EvalMetric]]]:
        """The suite's last `limit` finished runs, oldest first, each with its metrics (only `metric`'s, if given).

        Two queries: the runs, then their metrics.
        """
        with self._read() as conn:
            return self._evals.history(conn, suite, metric, limit)

    # --- internals --------------------------------------------------------------------------------

    # Guarded: a Ctrl-C or SIGTERM that comes during a transaction is raised once it has closed
    # (storage/signal_guard.py says what an open one left behind).
    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with guarded(), self._engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with guarded(), self._read_engine.begin() as conn:
            yield conn

    def _locking(self, query: Select[Any], skip_locked: bool = False) -> Select[Any]:
        return query.with_for_update(skip_locked=skip_locked) if self._row_locks else query

    def _no_job(self, job_id: str) -> StoreError:
        return StoreError(f"no job {job_id!r} in {self.url}; `layerbus status` lists the jobs")

    def _job_field(self, conn: Connection, job_id: str, column: Any) -> Any:
        """One column of the job's row; StoreError naming the job when there is no such job."""
        row = conn.execute(select(column).where(JOB.id == job_id)).one_or_none()
        if row is None:
            raise self._no_job(job_id)
        return row[0]

    def _lock_in_progress(self, conn: Connection, condition: Any) -> list[tuple[int, str]]:
        """(id, job_id) of in_progress items matching `condition`, locked in id order on PostgreSQL."""
        query = (
            select(ITEM.id, ITEM.job_id)
            .where(condition, ITEM.status == "in_progress")
            .order_by(ITEM.id)
        )
        return [(r.id, r.job_id) for r in conn.execute(self._locking(query))]

    def _requeue(self, conn: Connection, live: list[tuple[int, str]], now: datetime) -> list[int]:
        """Requeue the locked in-flight items `live` ((id, job_id)); those of cancelled jobs are cancelled.

        A job counts as cancelled once it has a cancelling_at (never cleared, even when a cancelling job
        then fails), so an item of it never goes back to queued and its count moves with it.
        """
        if not live:
            return []
        job_ids = {job_id for _, job_id in live}
        cancelled = set(conn.execute(
            select(JOB.id).where(JOB.id.in_(job_ids), JOB.cancelling_at.is_not(None))
        ).scalars())
        to_queue = [item_id for item_id, job_id in live if job_id not in cancelled]
        to_cancel = [item_id for item_id, job_id in live if job_id in cancelled]
        for chunk in _chunks(to_queue):
            conn.execute(
                update(items_table)
                .where(ITEM.id.in_(chunk))
                .values(status="queued", claimed_by=None, claimed_at=None, lease_expires_at=None)
            )
        for chunk in _chunks(to_cancel):
            conn.execute(
                update(items_table)
                .where(ITEM.id.in_(chunk))
                .values(status="cancelled", finish_reason="cancelled", finished_at=now)
            )
        changes = CountChanges()
        for _, job_id in live:  # in-flight items were all claimed, so each has run
            changes.move(job_id, "in_progress", "cancelled" if job_id in cancelled else "queued", 1, 1)
        changes.apply(conn)
        if cancelled:
            self._settle_cancelling(conn, cancelled, now)
        return to_queue

    def _settle_cancelling(self, conn: Connection, job_ids: set[str], now: datetime) -> None:
        """Move cancelling jobs among `job_ids` to cancelled once none of their items is in flight.

        Call it after applying this transaction's counter changes: it reads the in-flight counter.
        """
        query = select(JOB.id).where(JOB.id.in_(job_ids), JOB.status == "cancelling")
        for job_id in conn.execute(self._locking(query)).scalars().all():
            in_flight = conn.execute(
                select(COUNT["items"]).where(COUNT.job_id == job_id, COUNT.status == "in_progress")
            ).scalar_one()
            if in_flight == 0:
                conn.execute(update(jobs_table).where(JOB.id == job_id).values(status="cancelled", cancelled_at=now))

    def _result_pages(self, job_id: str, cancelled: bool) -> Iterator[dict[str, Any]]:
        """Result rows in seq order, one per sample (an item of n samples gives n rows, sample_index 0 to n-1);
        with `cancelled` (the job was cancelled), its still-queued items too, as the cancelled items they are
        (storage/item_counts.py)."""
        columns = [ITEM[name] for name in RESULT_COLUMNS if name != "sample_index"] + [ITEM.samples]
        states = FINISHED_ITEM_STATES + (("queued",) if cancelled else ())
        last_seq: int | None = None
        while True:
            query = select(*columns).where(ITEM.job_id == job_id, ITEM.status.in_(states))
            if last_seq is not None:
                query = query.where(ITEM.seq > last_seq)
            with self._read() as conn:
                page = conn.execute(query.order_by(ITEM.seq).limit(_PAGE)).mappings().all()
            for row in page:
                fields = dict(row)
                samples = fields.pop("samples")
                if row["status"] == "queued":
                    yield {**_as_cancelled(fields), "sample_index": 0}
                else:
                    yield from expand_samples(fields, samples)
            if len(page) < _PAGE:
                return
            last_seq = page[-1]["seq"]


def _as_cancelled(row: dict[str, Any]) -> dict[str, Any]:
    """A queued item's result row once its job was cancelled, as the cancel would have written it."""
    return {**row, "status": "cancelled", "finish_reason": "cancelled"}


def _holding(condition: Any, holder: str | None) -> Any:
    """`condition`, narrowed to the items `holder` holds unless holder is None."""
    return condition if holder is None else condition & (ITEM.claimed_by == holder)


def _chunks(values: list[int]) -> Iterator[list[int]]:
    for start in range(0, len(values), _PAGE):
        yield values[start : start + _PAGE]
