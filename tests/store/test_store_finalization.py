"""Several brokers, one job, in the store: exactly one finalizes (JobStore.claim_finalization and its hold),
and each broker's row in job_workers (items done, tokens, last renewal), read the same by JobStore and the
driver-only status path. Every test runs on a SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, text

from layerbus.storage.direct_status import read_job_workers
from layerbus.storage.errors import StoreError
from layerbus.storage.records import ItemResult
from layerbus.storage.store import JobStore
from tests.helpers.fixtures_stores import store, store_url  # noqa: F401 - fixtures
from tests.helpers.store_items import SETTINGS, T0, new_items, ok

A, B, C = "box-a:11:aa", "box-b:22:bb", "box-c:33:cc"


def finished_job(store: JobStore, items: int = 3) -> str:
    """A job whose every item is done, still in_progress: due for finalization."""
    job_id = store.create_job(SETTINGS, new_items(items), now=T0)
    claimed = store.claim_items(job_id, A, items, now=T0)
    store.complete_items([ok(c.item_id) for c in claimed], now=T0, holder=A)
    return job_id


def test_only_a_finished_job_is_finalized_and_only_by_the_first_claimer(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(2), now=T0)
    first, second = store.claim_items(job_id, A, 2, now=T0)
    store.complete_items([ok(first.item_id)], now=T0, holder=A)
    not_yet = store.claim_finalization(job_id, A, 30, now=T0)
    assert (not_yet.claimed, not_yet.status, not_yet.holder) == (False, "in_progress", None), "an item is in flight"
    store.complete_items([ok(second.item_id)], now=T0, holder=A)

    won = store.claim_finalization(job_id, B, 30, now=T0 + timedelta(seconds=1))
    lost = store.claim_finalization(job_id, A, 30, now=T0 + timedelta(seconds=2))

    assert (won.claimed, won.status, won.holder, won.expires_at) == (True, "finalizing", B, T0 + timedelta(seconds=31))
    assert (lost.claimed, lost.status, lost.holder) == (False, "finalizing", B)
    assert store.job_status(job_id).timestamps["finalizing_at"] == T0 + timedelta(seconds=1)
    assert store.job_finalization(job_id) == won.__class__(False, "finalizing", B, T0 + timedelta(seconds=31))


def test_a_finalizer_whose_hold_ran_out_or_who_is_gone_is_taken_over_and_cannot_end_the_job(store: JobStore) -> None:
    job_id = finished_job(store)
    assert store.claim_finalization(job_id, A, 10, now=T0).claimed
    assert store.renew_finalization(job_id, A, 10, now=T0 + timedelta(seconds=8))  # held until T0 + 18 s
    assert not store.claim_finalization(job_id, B, 10, now=T0 + timedelta(seconds=17)).claimed
    assert store.claim_finalization(job_id, B, 10, now=T0 + timedelta(seconds=19)).claimed
    assert store.claim_finalization(job_id, C, 10, gone=[B], now=T0 + timedelta(seconds=20)).claimed, "B is gone"

    assert not store.renew_finalization(job_id, A, 10, now=T0 + timedelta(seconds=21))
    assert not store.finish_finalization(job_id, A, "/a/file.parquet", "completed", now=T0 + timedelta(seconds=21))
    assert store.job_status(job_id).status == "finalizing", "the taken-over finalizer changed nothing"
    assert store.finish_finalization(job_id, C, "/c/file.parquet", "completed", now=T0 + timedelta(seconds=22))

    status = store.job_status(job_id)
    assert (status.status, status.results_path) == ("completed", "/c/file.parquet")
    assert store.job_finalization(job_id).holder == C and store.job_finalization(job_id).expires_at is None
    assert not store.claim_finalization(job_id, B, 10, now=T0 + timedelta(seconds=23)).claimed, "done is done"
    assert not store.finish_finalization(job_id, C, "/c/again.parquet", "completed"), "ended once"


def test_finishing_follows_the_lifecycle_and_records_why_a_job_failed(store: JobStore) -> None:
    job_id = finished_job(store)
    assert store.claim_finalization(job_id, A, 10, now=T0).claimed
    with pytest.raises(StoreError, match="cannot move from finalizing to queued"):
        store.finish_finalization(job_id, A, "/x.parquet", "queued")
    assert store.finish_finalization(job_id, A, "/x.parquet", "failed", error="every item failed (3 of 3)")
    status = store.job_status(job_id)
    assert (status.status, status.error, status.results_path) == ("failed", "every item failed (3 of 3)", "/x.parquet")


def test_a_cancelled_jobs_file_is_written_by_one_worker_and_the_job_stays_cancelled(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(4), now=T0)
    (claimed,) = store.claim_items(job_id, A, 1, now=T0)
    store.complete_items([ok(claimed.item_id)], now=T0, holder=A)
    assert store.cancel_job(job_id, now=T0) == "cancelled"

    assert store.claim_finalization(job_id, A, 10, now=T0).claimed
    assert not store.claim_finalization(job_id, B, 10, now=T0).claimed
    assert store.finish_finalization(job_id, A, "/cancelled.parquet", None)

    status = store.job_status(job_id)
    assert (status.status, status.results_path, status.completed, status.cancelled) == (
        "cancelled", "/cancelled.parquet", 1, 3)
    assert not store.claim_finalization(job_id, B, 10).claimed, "its file is written"


def _claim_finalization(url: str, job_id: str, worker: str, barrier, answers) -> None:  # type: ignore[no-untyped-def]
    with JobStore.open(url) as store:
        barrier.wait()
        answers.put((worker, store.claim_finalization(job_id, worker, 30).claimed))


def test_of_eight_processes_claiming_at_once_exactly_one_finalizes(store: JobStore, store_url: str) -> None:
    job_id = finished_job(store)
    context = multiprocessing.get_context("spawn")
    barrier, answers = context.Barrier(8), context.Queue()
    workers = [context.Process(target=_claim_finalization, args=(store_url, job_id, f"host:{n}:ff", barrier, answers))
               for n in range(8)]
    for worker in workers:
        worker.start()
    results = dict(answers.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(30)
    winners = [worker for worker, claimed in results.items() if claimed]
    assert len(results) == 8 and len(winners) == 1
    assert store.job_finalization(job_id).holder == winners[0]


def test_each_worker_counts_what_it_recorded_and_stamps_its_renewals(store: JobStore, store_url: str) -> None:
    job_id = store.create_job(SETTINGS, new_items(5), now=T0)
    store.register_worker(job_id, A, "box-a", "stage-0 [0, 15) -> stage-1 [15, 30)", 20, now=T0)
    store.register_worker(job_id, B, "box-b", None, 60, now=T0 + timedelta(seconds=1))
    mine = store.claim_items(job_id, A, 3, now=T0)
    theirs = store.claim_items(job_id, B, 2, now=T0)
    store.complete_items([ok(c.item_id, tokens=4) for c in mine], now=T0, holder=A)
    store.complete_items([ok(theirs[0].item_id, tokens=7)], now=T0, holder=B)
    failure = ItemResult(theirs[1].item_id, None, "error", 3, 0, 0.1, error="boom")
    store.complete_items([failure, ok(mine[0].item_id)], now=T0, holder=B)  # A's item: refused, not counted
    store.renew_leases(job_id, A, 20, now=T0 + timedelta(seconds=30))
    store.set_worker_state(job_id, B, "stopped", now=T0 + timedelta(seconds=9))

    a, b = store.job_workers(job_id)
    assert (a.worker, a.host, a.chain, a.state, a.items_done, a.completion_tokens, a.lease_s) == (
        A, "box-a", "stage-0 [0, 15) -> stage-1 [15, 30)", "working", 3, 12, 20.0)
    assert (a.started_at, a.renewed_at, a.tokens_per_s) == (T0, T0 + timedelta(seconds=30), pytest.approx(0.4))
    assert (b.worker, b.state, b.items_done, b.completion_tokens, b.renewed_at) == (
        B, "stopped", 2, 7, T0 + timedelta(seconds=9))
    assert a.state_at(T0 + timedelta(seconds=49)) == "working"
    assert a.state_at(T0 + timedelta(seconds=51)) == "lost", "silent for longer than its lease"
    assert b.state_at(T0 + timedelta(days=1)) == "stopped"

    store.register_worker(job_id, A, "box-a", "stage-0 [0, 30)", 20, now=T0 + timedelta(seconds=40))
    (again,) = [w for w in store.job_workers(job_id) if w.worker == A]
    assert (again.items_done, again.started_at, again.chain) == (3, T0, "stage-0 [0, 30)"), "same process: kept"
    assert read_job_workers(store_url, job_id) == store.job_workers(job_id)
    assert read_job_workers(store_url, "job_missing") == []
    with pytest.raises(ValueError, match="worker state 'idle'"):
        store.set_worker_state(job_id, A, "idle")


def test_a_store_from_before_several_brokers_gains_the_columns_and_the_table(store_url: str) -> None:
    with JobStore.open(store_url) as store:
        job_id = finished_job(store)
        store.set_job_status(job_id, "finalizing")  # an older layerbus was killed while finalizing
    engine = create_engine(store_url)
    with engine.begin() as conn:  # the tables as a layerbus before several brokers made them
        conn.execute(text("ALTER TABLE jobs DROP COLUMN finalized_by"))
        conn.execute(text("ALTER TABLE jobs DROP COLUMN finalize_lease_expires_at"))
        conn.execute(text("DROP TABLE job_workers"))
    engine.dispose()
    assert read_job_workers(store_url, job_id) == [], "status on the old store: no workers yet"
    with JobStore.open(store_url) as store:
        assert store.job_workers(job_id) == []
        assert store.claim_finalization(job_id, A, 10).claimed, "nobody holds an old finalization"


def test_a_generated_nul_character_is_recorded_on_either_store(store: JobStore, store_url: str) -> None:
    job_id = store.create_job(SETTINGS, new_items(2), now=T0)
    first, second = store.claim_items(job_id, A, 2, now=T0)
    nul = ItemResult(first.item_id, "a\x00b", "length", 3, 3, 0.1)
    failed = ItemResult(second.item_id, None, "error", 3, 0, 0.1, error="bad byte \x00")
    assert store.complete_items([nul, failed], holder=A) == [first.item_id, second.item_id]
    rows = {row["custom_id"]: row for row in store.item_results(job_id)}
    kept = "\x00" if store_url.startswith("sqlite") else "\ufffd"  # PostgreSQL text cannot hold NUL
    assert (rows["id-0"]["output"], rows["id-1"]["error"]) == (f"a{kept}b", f"bad byte {kept}")
