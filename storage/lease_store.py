"""Claims as leases: handing queued items out to a worker, recording what its holder returns, handing items
back, renewing the holder's leases and the sweep that requeues what nobody holds any more.

Claims are exclusive: BEGIN IMMEDIATE on SQLite, row locks with SKIP LOCKED on PostgreSQL, so any number
of broker processes can claim from one job. Only a holder may record or hand back what it holds
(storage/leases.py), so an item taken over after its lease ran out is never recorded twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from layerbus.storage import job_workers as workers
from layerbus.storage.clock import utc_now
from layerbus.storage.document_parts import advance_parents, finished_parts
from layerbus.storage.item_counts import CountChanges
from layerbus.storage.leases import held_by, job_leases, lease_end, reclaimable
from layerbus.storage.lifecycle_store import settle_cancelling
from layerbus.storage.records import ClaimedItem, ItemResult, Lease
from layerbus.storage.rows import claimed_item, result_params
from layerbus.storage.schema import items as items_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.states import RUNNABLE_JOB_STATES, check_finish_reason
from layerbus.storage.store_db import StoreDb, chunks

ITEM = items_table.c
JOB = jobs_table.c


class ItemLeases:
    """JobStore's claim_items, complete_items, requeue_items, requeue_in_flight, renew_leases, job_leases and
    requeue_expired."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    def claim_items(self, job_id: str, worker: str, limit: int, now: datetime | None,
                    lease_s: float) -> list[ClaimedItem]:
        """Move up to `limit` queued items (in seq order) to in_progress for `worker`, leased until
        `now + lease_s` (renew_leases pushes that on); [] when none are left.

        The first claim moves the job from queued to in_progress, even when it hands out nothing: a job
        whose items were all refused at submit still goes in_progress -> finalizing like any other.
        Jobs that are not queued or in_progress (cancelling, finalizing, ...) hand out nothing.
        """
        if limit < 1:
            raise ValueError(f"claim_items needs limit >= 1, got {limit=}")
        now = utc_now(now)
        expires = lease_end(now, lease_s)
        with self._db.write() as conn:
            job_status = self._db.job_field(conn, job_id, JOB.status)
            if job_status not in RUNNABLE_JOB_STATES:
                return []
            query = (
                select(ITEM.id, ITEM.custom_id, ITEM.seq, ITEM.input, ITEM.prompt, ITEM.params_json, ITEM.attempts,
                       ITEM.parent_id, ITEM.combine)
                .where(ITEM.job_id == job_id, ITEM.status == "queued")
                .order_by(ITEM.seq)
                .limit(limit)
            )
            rows = conn.execute(self._db.locking(query, skip_locked=True)).all()
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

    def complete_items(self, results: Sequence[ItemResult], now: datetime | None, holder: str | None) -> list[int]:
        """Record results of in_progress items (failed when error is set); returns the ids written.

        An item whose parts (a long document's) are then all finished moves on in the same transaction
        (storage/document_parts.py). Items no longer in_progress (already finished, cancelled, requeued) are
        skipped, so a late duplicate result never overwrites a final one; with `holder`, so are items it no longer holds
        (its lease ran out and another worker claimed them). Within `results`, the first result for an id wins.
        """
        now = utc_now(now)
        first: dict[int, ItemResult] = {}
        for result in results:
            check_finish_reason(result.item_id, result.finish_reason)
            first.setdefault(result.item_id, result)
        written: set[int] = set()
        changes = CountChanges()
        done_by_job: dict[str, tuple[int, int]] = {}  # job_id -> (items, generated tokens) recorded
        with self._db.write() as conn:
            for chunk in chunks(list(first)):
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
                    [result_params(first[item_id], no_nul=self._db.no_nul) for item_id, _ in live],
                )
                written.update(item_id for item_id, _ in live)
                for item_id, job_id in live:
                    result = first[item_id]
                    changes.add(job_id, "in_progress", -1, -1)
                    changes.add(job_id, result.status, 1, 1, result.prompt_tokens, result.completion_tokens)
                    items, tokens = done_by_job.get(job_id, (0, 0))
                    done_by_job[job_id] = (items + 1, tokens + (result.completion_tokens or 0))
            # A long document's parts: the item they make moves on in this transaction (storage/document_parts.py).
            advance_parents(self._db, conn, finished_parts(conn, sorted(written)), changes, now)
            jobs = {job_id for job_id, _ in changes.deltas}
            changes.apply(conn)
            if holder is not None:  # the worker's own tally, for `layerbus status JOB`'s workers
                workers.count_done(conn, holder, done_by_job)
            settle_cancelling(self._db, conn, jobs, now)
        return [item_id for item_id in first if item_id in written]

    def requeue_items(self, item_ids: Iterable[int], now: datetime | None, holder: str | None) -> list[int]:
        """Move in_progress items back to queued (for a retry); returns the ids requeued.

        Items of a cancelling job are cancelled instead, and the job becomes cancelled once nothing
        of it is in flight. Items not in_progress, and with `holder` items it does not hold, are left alone.
        """
        now = utc_now(now)
        with self._db.write() as conn:
            live: list[tuple[int, str]] = []
            for chunk in chunks(list(dict.fromkeys(item_ids))):
                live += self._lock_in_progress(conn, _holding(ITEM.id.in_(chunk), holder))
            return self._requeue(conn, live, now)

    def requeue_in_flight(self, job_id: str, now: datetime | None) -> int:
        """Requeue every in_progress item of a job whoever holds it; returns how many were requeued.

        Only for when every worker of the job is known to be gone: a live holder's results would then be
        refused. Brokers requeue with requeue_expired, which takes only what nobody holds any more.
        """
        now = utc_now(now)
        with self._db.write() as conn:
            self._db.job_field(conn, job_id, JOB.status)
            live = self._lock_in_progress(conn, ITEM.job_id == job_id)
            return len(self._requeue(conn, live, now))

    def renew_leases(self, job_id: str, holder: str, lease_s: float, now: datetime | None) -> int:
        """Push the lease of every item `holder` has in flight in the job to `now + lease_s`; how many.

        An item whose lease ran out but which nobody requeued yet is still the holder's, and is renewed.
        """
        now = utc_now(now)
        expires = lease_end(now, lease_s)
        with self._db.write() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            held = [item_id for item_id, _ in self._lock_in_progress(conn, (ITEM.job_id == job_id) & held_by(holder))]
            for chunk in chunks(held):
                conn.execute(update(items_table).where(ITEM.id.in_(chunk)).values(lease_expires_at=expires))
            workers.stamp(conn, job_id, holder, now)  # its last renewal, for `layerbus status JOB`
        return len(held)

    def job_leases(self, job_id: str) -> list[Lease]:
        """Who holds the job's in-flight items, how many each, and when the first of their leases runs out."""
        with self._db.read() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            return job_leases(conn, job_id)

    def requeue_expired(self, job_id: str, now: datetime | None, holders: Sequence[str],
                        keep: str | None) -> dict[str, int]:
        """Requeue the job's in-flight items whose lease ran out by `now` (or that have none), and those of
        `holders` (workers known to be gone), except those `keep` holds; how many per holder.

        Items of a cancelling job are cancelled instead (not counted), as requeue_items does.
        """
        now = utc_now(now)
        with self._db.write() as conn:
            self._db.job_field(conn, job_id, JOB.id)
            condition = (ITEM.job_id == job_id) & reclaimable(now, holders)
            if keep is not None:
                condition &= ITEM.claimed_by.is_distinct_from(keep)
            query = select(ITEM.id, ITEM.claimed_by).where(condition, ITEM.status == "in_progress").order_by(ITEM.id)
            found = conn.execute(self._db.locking(query)).all()
            requeued = set(self._requeue(conn, [(row.id, job_id) for row in found], now))
        counts: dict[str, int] = {}
        for row in found:
            if row.id in requeued:
                counts[row.claimed_by or ""] = counts.get(row.claimed_by or "", 0) + 1
        return counts

    def _lock_in_progress(self, conn: Connection, condition: Any) -> list[tuple[int, str]]:
        """(id, job_id) of in_progress items matching `condition`, locked in id order on PostgreSQL."""
        query = (
            select(ITEM.id, ITEM.job_id)
            .where(condition, ITEM.status == "in_progress")
            .order_by(ITEM.id)
        )
        return [(r.id, r.job_id) for r in conn.execute(self._db.locking(query))]

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
        for chunk in chunks(to_queue):
            conn.execute(
                update(items_table)
                .where(ITEM.id.in_(chunk))
                .values(status="queued", claimed_by=None, claimed_at=None, lease_expires_at=None)
            )
        for chunk in chunks(to_cancel):
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
            settle_cancelling(self._db, conn, cancelled, now)
        return to_queue


def _holding(condition: Any, holder: str | None) -> Any:
    """`condition`, narrowed to the items `holder` holds unless holder is None."""
    return condition if holder is None else condition & (ITEM.claimed_by == holder)
