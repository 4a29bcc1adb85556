"""The JobStore contract: every test runs against a SQLite file and a real PostgreSQL database.

The reads the light commands also make through the store's driver alone are made through both paths and
compared on every call (tests/helpers/fixtures_stores.py's TwinPathStore), and the cancel tests cancel through each."""

from __future__ import annotations

import multiprocessing
import queue
import random
import threading
import time
from collections import Counter
from datetime import datetime, timedelta

import pytest
from sqlalchemy import create_engine, func, select, text

from layerbus.storage.errors import StoreError
from layerbus.storage.item_counts import read_counts, recount
from layerbus.storage.records import InvalidItem, ItemResult, JobSettings, Lease, NewItem
from layerbus.planner.sample_places import sample_places
from layerbus.storage.schema import items as items_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.store import JobStore
from tests.helpers.fixtures_stores import CANCEL_PATHS, TwinPathStore, store, store_url  # noqa: F401 - fixtures
from tests.helpers.store_items import SETTINGS, T0, new_items, ok


def test_create_job_queues_every_item_and_stamps_created_and_queued(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(3), now=T0)
    status = store.job_status(job_id, now=T0)
    assert job_id.startswith("job_") and len(job_id) == 16
    assert (status.status, status.total, status.queued, status.name) == ("queued", 3, 3, "demo")
    assert status.timestamps["created_at"] == T0 and status.timestamps["queued_at"] == T0
    assert status.timestamps["in_progress_at"] is None
    assert store.job_settings(job_id) == SETTINGS


def test_claims_follow_seq_order_count_attempts_and_start_the_job(store: JobStore) -> None:
    shuffled = [NewItem(f"id-{s}", "t", f"p{s}", {"seed": s}, s) for s in (5, 1, 3, 2, 4)]
    job_id = store.create_job(SETTINGS, shuffled, now=T0)
    claimed = store.claim_items(job_id, "w1", 3, now=T0 + timedelta(seconds=1))
    assert [c.custom_id for c in claimed] == ["id-1", "id-2", "id-3"]
    assert claimed[0].params == {"seed": 1} and claimed[0].prompt == "p1"
    assert all(c.attempts == 1 and c.job_id == job_id for c in claimed)
    status = store.job_status(job_id)
    assert status.status == "in_progress" and status.timestamps["in_progress_at"] == T0 + timedelta(seconds=1)
    assert (status.in_progress, status.queued) == (3, 2)
    assert [c.custom_id for c in store.claim_items(job_id, "w2", 10)] == ["id-4", "id-5"]
    assert store.claim_items(job_id, "w2", 10) == []


def test_complete_items_records_outputs_and_failures(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(2), now=T0)
    first, second = store.claim_items(job_id, "w", 2)
    failure = ItemResult(second.item_id, None, "error", 3, 0, 0.1, error="CUDA out of memory")
    assert store.complete_items([ok(first.item_id), failure]) == [first.item_id, second.item_id]
    rows = list(store.item_results(job_id))
    assert [(r["custom_id"], r["status"], r["output"], r["error"]) for r in rows] == [
        ("id-0", "completed", f"out {first.item_id}", None),
        ("id-1", "failed", None, "CUDA out of memory"),
    ]
    status = store.job_status(job_id)
    assert (status.completed, status.failed, status.completion_tokens, status.prompt_tokens) == (1, 1, 5, 6)


def test_late_duplicate_completion_never_overwrites_a_final_result(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(1))
    (item,) = store.claim_items(job_id, "w", 1)
    assert store.complete_items([ok(item.item_id, tokens=5)]) == [item.item_id]
    late = ItemResult(item.item_id, "stale", "length", 3, 9, 9.0)
    assert store.complete_items([late]) == []
    (row,) = store.item_results(job_id)
    assert (row["output"], row["completion_tokens"]) == (f"out {item.item_id}", 5)


def test_requeued_items_are_claimed_again_with_more_attempts(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(3))
    claimed = store.claim_items(job_id, "w1", 3)
    assert store.requeue_items([claimed[0].item_id, claimed[0].item_id, 999_999]) == [claimed[0].item_id]
    again = store.claim_items(job_id, "w2", 5)
    assert [(c.custom_id, c.attempts) for c in again] == [("id-0", 2)]
    store.complete_items([ok(again[0].item_id)])
    assert store.requeue_items([again[0].item_id]) == []  # finished items stay finished


def test_requeue_in_flight_returns_every_claimed_item_of_the_job(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(4))
    other = store.create_job(SETTINGS, new_items(2))
    store.claim_items(job_id, "w", 3)
    store.claim_items(other, "w", 2)
    assert store.requeue_in_flight(job_id) == 3
    assert (store.job_status(job_id).queued, store.job_status(other).in_progress) == (4, 2)


def test_invalid_items_are_recorded_failed_with_their_error(store: JobStore) -> None:
    bad = [InvalidItem("line-3", '{"text": ', "line 3: not valid JSON", 2)]
    job_id = store.create_job(SETTINGS, new_items(2), bad, now=T0)
    status = store.job_status(job_id)
    assert (status.total, status.queued, status.failed) == (3, 2, 1)
    assert [c.custom_id for c in store.claim_items(job_id, "w", 5)] == ["id-0", "id-1"]
    failed = [r for r in store.item_results(job_id) if r["status"] == "failed"]
    assert failed == [
        {"custom_id": "line-3", "seq": 2, "input": '{"text": ', "output": None, "finish_reason": "error",
         "prompt_tokens": None, "completion_tokens": None, "latency_s": None,
         "error": "line 3: not valid JSON", "status": "failed", "logprobs": None, "sample_index": 0}
    ]  # fmt: skip


def test_a_job_of_only_refused_items_still_runs_through_in_progress(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, [], [InvalidItem("line-1", "", "empty line", 0)], now=T0)
    assert store.claim_items(job_id, "w", 8, now=T0 + timedelta(seconds=1)) == []
    status = store.job_status(job_id)
    assert (status.status, status.failed) == ("in_progress", 1)
    assert status.timestamps["in_progress_at"] == T0 + timedelta(seconds=1)
    store.set_job_status(job_id, "finalizing")
    store.set_job_status(job_id, "completed")


def test_create_job_is_all_or_nothing(store: JobStore, store_url: str) -> None:
    items = new_items(5000)
    items.append(NewItem("id-17", "again", "again", {}, 5000))  # fails in the database, mid-insert
    with pytest.raises(StoreError, match=r"custom_id 'id-17' appears more than once.*nothing was queued"):
        store.create_job(SETTINGS, items)
    assert store.list_jobs() == [] and store.latest_job_id() is None and store.next_runnable_job() is None
    engine = create_engine(store_url)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(items_table)).scalar_one() == 0
    engine.dispose()


@CANCEL_PATHS
def test_cancel_with_nothing_in_flight_is_immediate_and_keeps_finished_outputs(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(3), now=T0)
    (item,) = store.claim_items(job_id, "w", 1)
    store.complete_items([ok(item.item_id)])
    assert store.cancel_job(job_id, now=T0 + timedelta(seconds=9)) == "cancelled"
    status = store.job_status(job_id)
    assert (status.status, status.completed, status.cancelled, status.queued) == ("cancelled", 1, 2, 0)
    assert status.timestamps["cancelled_at"] == T0 + timedelta(seconds=9)
    assert {r["finish_reason"] for r in store.item_results(job_id) if r["status"] == "cancelled"} == {"cancelled"}
    assert store.claim_items(job_id, "w", 5) == []
    assert store.cancel_job(job_id) == "cancelled"  # twice is harmless


@CANCEL_PATHS
def test_cancel_with_items_in_flight_waits_for_them(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(4))
    first, second = store.claim_items(job_id, "w", 2)
    assert store.cancel_job(job_id) == "cancelling"
    assert store.claim_items(job_id, "w", 5) == [] and store.next_runnable_job() is None
    assert store.complete_items([ok(first.item_id)]) == [first.item_id]  # finished outputs are kept
    assert store.job_status(job_id).status == "cancelling"
    assert store.requeue_items([second.item_id]) == []  # a retry of a cancelling job cancels the item
    status = store.job_status(job_id)
    assert (status.status, status.completed, status.cancelled) == ("cancelled", 1, 3)


@CANCEL_PATHS
def test_cancel_of_a_finished_job_is_refused(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(1))
    store.complete_items([ok(i.item_id) for i in store.claim_items(job_id, "w", 1)])
    store.set_job_status(job_id, "finalizing")
    store.set_job_status(job_id, "completed")
    with pytest.raises(StoreError, match="is completed: only validating, queued, in_progress jobs can be cancelled"):
        store.cancel_job(job_id)


def test_lifecycle_to_completed_stamps_every_state(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(1), now=T0)
    store.claim_items(job_id, "w", 1, now=T0 + timedelta(seconds=1))
    store.set_job_status(job_id, "finalizing", now=T0 + timedelta(seconds=2))
    store.set_results_path(job_id, "/results/x.parquet")
    store.set_job_status(job_id, "completed", now=T0 + timedelta(seconds=3))
    status = store.job_status(job_id)
    assert status.status == "completed" and status.results_path == "/results/x.parquet"
    stamps = {k: v for k, v in status.timestamps.items() if v is not None}
    assert stamps == {
        "created_at": T0, "queued_at": T0, "in_progress_at": T0 + timedelta(seconds=1),
        "finalizing_at": T0 + timedelta(seconds=2), "completed_at": T0 + timedelta(seconds=3),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("moves", "target"),
    [([], "completed"), ([], "finalizing"), (["failed"], "queued"), ([], "cancelled"), ([], "bogus")],
)
def test_forbidden_transitions_name_both_states(store: JobStore, moves: list[str], target: str) -> None:
    job_id = store.create_job(SETTINGS, new_items(1))
    for move in moves:
        store.set_job_status(job_id, move, error="model not found")
    current = moves[-1] if moves else "queued"
    pattern = "unknown job state 'bogus'" if target == "bogus" else f"cannot move from {current} to {target}"
    with pytest.raises(StoreError, match=pattern):
        store.set_job_status(job_id, target)
    assert store.job_status(job_id).status == current


def test_failed_job_keeps_its_error(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(1), now=T0)
    store.set_job_status(job_id, "failed", error="model 'x' not found: check the name", now=T0)
    status = store.job_status(job_id)
    assert (status.status, status.timestamps["failed_at"]) == ("failed", T0)
    assert status.error == "model 'x' not found: check the name"


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.job_status("job_missing"),
        lambda s: s.claim_items("job_missing", "w", 1),
        lambda s: s.set_job_status("job_missing", "failed"),
        lambda s: s.cancel_job("job_missing"),
        lambda s: s.requeue_in_flight("job_missing"),
        lambda s: s.set_results_path("job_missing", "x"),
        lambda s: s.item_results("job_missing"),
        lambda s: s.job_settings("job_missing"),
    ],
)
def test_unknown_job_names_the_job_the_store_and_the_way_out(store: JobStore, call) -> None:
    with pytest.raises(StoreError) as raised:
        call(store)
    assert str(raised.value) == f"no job 'job_missing' in {store.url}; `layerbus status` lists the jobs"


def test_clock_injection_drives_throughput_and_eta(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(10), now=T0)
    claimed = store.claim_items(job_id, "w", 4, now=T0 + timedelta(seconds=10))
    store.complete_items([ok(c.item_id, tokens=25) for c in claimed], now=T0 + timedelta(seconds=20))
    status = store.job_status(job_id, now=T0 + timedelta(seconds=30))
    # 100 tokens in the 20 s since in_progress; 4 items in 20 s leaves 6 items for 30 s.
    assert (status.tokens_per_s, status.eta_s) == (5.0, 30.0)
    store.set_job_status(job_id, "failed", now=T0 + timedelta(seconds=60))
    later = store.job_status(job_id, now=T0 + timedelta(days=1))
    assert (later.tokens_per_s, later.eta_s) == (2.0, None)  # the run ended at 60 s


def test_naive_datetimes_are_refused(store: JobStore) -> None:
    with pytest.raises(ValueError, match="naive datetime 2030-01-01T00:00:00 given to the job store"):
        store.create_job(SETTINGS, new_items(1), now=datetime(2030, 1, 1))
    job_id = store.create_job(SETTINGS, new_items(1))
    with pytest.raises(ValueError, match="naive datetime"):
        store.job_status(job_id, now=datetime(2030, 1, 1))


@CANCEL_PATHS
def test_listing_latest_and_next_runnable(store: JobStore) -> None:
    older = store.create_job(SETTINGS, new_items(1), now=T0)
    newer = store.create_job(SETTINGS, new_items(2), now=T0 + timedelta(minutes=1))
    assert store.latest_job_id() == newer and store.next_runnable_job() == older
    assert [(s.job_id, s.total) for s in store.list_jobs()] == [(newer, 2), (older, 1)]
    assert [s.job_id for s in store.list_jobs(limit=1)] == [newer]
    store.cancel_job(older)
    assert store.next_runnable_job() == newer


def test_find_job_by_name_returns_the_newest_job_of_that_name(store: JobStore) -> None:
    named = JobSettings(task="lm-eval", model="tiny-model", name="lm-eval-abc")
    assert store.find_job_by_name("lm-eval-abc") is None
    older = store.create_job(named, new_items(1), now=T0)
    store.create_job(SETTINGS, new_items(1), now=T0 + timedelta(minutes=2))  # another name, newer
    assert store.find_job_by_name("lm-eval-abc") == older
    newer = store.create_job(named, new_items(1), now=T0 + timedelta(minutes=1))
    assert store.find_job_by_name("lm-eval-abc") == newer
    assert store.find_job_by_name("lm-eval-ab") is None  # exact match, not a prefix
    with pytest.raises(ValueError, match="non-empty name"):
        store.find_job_by_name("")


def test_item_results_pages_through_large_jobs_in_seq_order(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(2500))
    while claimed := store.claim_items(job_id, "w", 500):
        store.complete_items([ok(c.item_id) for c in claimed])
    seqs = [row["seq"] for row in store.item_results(job_id)]
    assert seqs == list(range(2500))


def test_job_status_counts_10000_items(store: JobStore) -> None:
    # How fast that is, is measured by bench/bench_store.py (a timing here would fail on a busy machine).
    job_id = store.create_job(SETTINGS, new_items(10_000))
    store.complete_items([ok(c.item_id) for c in store.claim_items(job_id, "w", 3000)])
    store.claim_items(job_id, "w", 500)
    status = store.job_status(job_id)
    assert (status.total, status.completed, status.in_progress, status.queued) == (10_000, 3000, 500, 6500)


def _claim_until_empty(url: str, job_id: str, worker: str, barrier, results) -> None:  # type: ignore[no-untyped-def]
    """A claimer process: claim small batches and complete them until nothing is left."""
    claimed: list[int] = []
    with JobStore.open(url) as store:
        barrier.wait(timeout=60)
        while batch := store.claim_items(job_id, worker, 7):
            claimed += [c.item_id for c in batch]
            store.complete_items([ok(c.item_id) for c in batch])
    results.put((worker, claimed))


def _collect(results, workers: list) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Each worker's claims; fails fast when a worker dies instead of waiting out a timeout."""
    per_worker: dict[str, list[int]] = {}
    deadline = time.monotonic() + 120
    while len(per_worker) < len(workers) and time.monotonic() < deadline:
        try:
            worker, claimed = results.get(timeout=0.5)
            per_worker[worker] = claimed
        except queue.Empty:
            crashed = [p.name for p in workers if p.exitcode not in (None, 0)]
            assert not crashed, f"claimer processes {crashed} crashed; see their traceback above"
    for process in workers:
        process.join(timeout=30)
        assert process.exitcode == 0
    return per_worker


@pytest.mark.cluster
def test_eight_claimer_processes_claim_every_item_exactly_once(store: JobStore, store_url: str) -> None:
    job_id = store.create_job(SETTINGS, new_items(2000))
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(8), context.Queue()
    workers = [
        context.Process(target=_claim_until_empty, args=(store_url, job_id, f"w{n}", barrier, results))
        for n in range(8)
    ]
    for process in workers:
        process.start()
    per_worker = _collect(results, workers)
    claims = Counter(item_id for claimed in per_worker.values() for item_id in claimed)
    assert [item_id for item_id, n in claims.items() if n > 1] == []
    assert len(claims) == 2000
    assert sum(1 for claimed in per_worker.values() if claimed) >= 2, "claims were not concurrent"
    status = store.job_status(job_id)
    assert (status.completed, status.queued, status.in_progress) == (2000, 0, 0)


def test_job_items_give_back_every_item_as_queued_in_seq_order(store: JobStore) -> None:
    items = [NewItem(f"id-{s}", f"in {s}", f"p{s}", {"score": [[[1, 2], [[3]]]], "n": s}, s) for s in (3, 1, 2)]
    job_id = store.create_job(SETTINGS, items, [InvalidItem("bad", "{oops", "not JSON", 9)], now=T0)
    got = list(store.job_items(job_id))
    assert got[:3] == sorted(items, key=lambda item: item.seq)
    assert (got[3].custom_id, got[3].prompt, got[3].seq) == ("bad", "", 9)
    with pytest.raises(StoreError, match="job_nothere"):
        list(store.job_items("job_nothere"))


def test_a_sample_of_items_is_spread_evenly_over_the_job_whatever_gaps_its_seqs_have(store: JobStore) -> None:
    # seqs as line numbers give them: from 1, with gaps (blank lines), every other one for a stretch
    seqs = list(range(1, 41)) + list(range(42, 122, 2)) + list(range(200, 220))
    items = [NewItem(f"id-{s}", f"in {s}", f"p{s}", {"max_tokens": s}, s) for s in seqs]
    job_id = store.create_job(SETTINGS, items[:-1], [InvalidItem("bad", "{oops", "not JSON", seqs[-1])], now=T0)
    sample = store.sample_items(job_id, 10)
    # one item from each tenth of the job, by place in seq order (storage.sample_places)
    places = [6, 12, 28, 34, 40, 57, 63, 79, 85, 91]
    assert sample_places(10, 100) == places and [item.seq for item in sample.items] == [seqs[p] for p in places]
    assert sample.items[0] == items[6] and (sample.total, sample.whole) == (100, False)
    assert [item.seq for item in store.sample_items(job_id, 3).items] == [seqs[p] for p in sample_places(3, 100)]
    everything = store.sample_items(job_id, 100)
    assert everything.whole and everything.items[:-1] == tuple(items[:-1])
    assert (everything.items[-1].custom_id, everything.items[-1].prompt) == ("bad", "")  # refused: no prompt
    assert store.sample_items(job_id, 1000).items == everything.items
    with pytest.raises(StoreError, match="job_nothere"):
        store.sample_items("job_nothere", 10)
    with pytest.raises(ValueError, match="count=0"):
        store.sample_items(job_id, 0)


def test_a_sample_of_items_whose_seqs_have_no_gap_is_read_by_seq(store: JobStore) -> None:
    items = new_items(999, start=1)  # lines 1 to 999, and line 1000 refused: an item too
    job_id = store.create_job(SETTINGS, items, [InvalidItem("bad", "{oops", "not JSON", 1000)], now=T0)
    sample = store.sample_items(job_id, 64)
    assert [item.seq for item in sample.items] == [1 + p for p in sample_places(64, 1000)]
    assert sample.items[0] == items[sample_places(64, 1000)[0]] and sample.total == 1000


# --- leases: a claim is held until a time its holder keeps pushing on ---------------------------------------------


def test_a_claim_records_its_holder_and_the_end_of_its_lease(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(5), now=T0)
    store.claim_items(job_id, "host-a:11:aa", 3, now=T0, lease_s=60)
    store.claim_items(job_id, "host-b:22:bb", 1, now=T0 + timedelta(seconds=5), lease_s=30)
    assert store.job_leases(job_id) == [
        Lease("host-a:11:aa", 3, T0 + timedelta(seconds=60)),
        Lease("host-b:22:bb", 1, T0 + timedelta(seconds=35)),
    ]
    with pytest.raises(ValueError, match=r"lease of 0 s: a lease must last a positive number of seconds"):
        store.claim_items(job_id, "w", 1, lease_s=0)


def test_renewing_pushes_on_only_the_holders_own_leases(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(4), now=T0)
    mine = store.claim_items(job_id, "me", 2, now=T0, lease_s=60)
    store.claim_items(job_id, "other", 2, now=T0, lease_s=60)
    store.complete_items([ok(mine[0].item_id)], holder="me")
    assert store.renew_leases(job_id, "me", lease_s=60, now=T0 + timedelta(seconds=50)) == 1  # the one still in flight
    assert store.job_leases(job_id) == [Lease("me", 1, T0 + timedelta(seconds=110)),
                                        Lease("other", 2, T0 + timedelta(seconds=60))]
    assert store.requeue_expired(job_id, now=T0 + timedelta(seconds=61)) == {"other": 2}
    assert (store.job_status(job_id).queued, store.job_status(job_id).in_progress) == (2, 1)


def test_only_expired_items_are_requeued(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(6), now=T0)
    store.claim_items(job_id, "dead", 2, now=T0, lease_s=60)
    store.claim_items(job_id, "alive", 2, now=T0 + timedelta(seconds=30), lease_s=60)
    assert store.requeue_expired(job_id, now=T0 + timedelta(seconds=59)) == {}  # nothing has run out yet
    assert store.requeue_expired(job_id, now=T0 + timedelta(seconds=61)) == {"dead": 2}
    assert store.job_leases(job_id) == [Lease("alive", 2, T0 + timedelta(seconds=90))]
    again = store.claim_items(job_id, "alive", 10, now=T0 + timedelta(seconds=62))
    assert [(c.custom_id, c.attempts) for c in again] == [("id-0", 2), ("id-1", 2), ("id-4", 1), ("id-5", 1)]


def test_known_gone_holders_are_requeued_before_their_leases_run_out_and_keep_is_spared(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(6), now=T0)
    for worker in ("gone", "me", "alive"):
        store.claim_items(job_id, worker, 2, now=T0, lease_s=60)
    soon = T0 + timedelta(seconds=1)
    assert store.requeue_expired(job_id, now=soon, holders=["gone"]) == {"gone": 2}
    late = T0 + timedelta(seconds=61)  # every lease has run out, but this process is "me" and alive
    assert store.requeue_expired(job_id, now=late, keep="me") == {"alive": 2}
    assert [lease.holder for lease in store.job_leases(job_id)] == ["me"]


def test_a_holder_whose_lease_was_lost_and_reclaimed_records_nothing(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(2), now=T0)
    slow_done, slow_failed = store.claim_items(job_id, "slow", 2, now=T0, lease_s=10)
    assert store.requeue_expired(job_id, now=T0 + timedelta(seconds=11)) == {"slow": 2}
    taken = store.claim_items(job_id, "fast", 2, now=T0 + timedelta(seconds=12), lease_s=10)
    assert [c.item_id for c in taken] == [slow_done.item_id, slow_failed.item_id]
    late_failure = ItemResult(slow_failed.item_id, None, "error", 3, 0, 0.1, error="stale stage")
    assert store.complete_items([ok(slow_done.item_id, tokens=99), late_failure], holder="slow") == []
    assert store.requeue_items([slow_done.item_id], holder="slow") == []  # its hand-back takes nothing either
    assert store.renew_leases(job_id, "slow", now=T0 + timedelta(seconds=13)) == 0
    assert store.complete_items([ok(c.item_id) for c in taken], holder="fast") == [c.item_id for c in taken]
    rows = list(store.item_results(job_id))
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [("completed", 5), ("completed", 5)]


def test_an_expired_lease_nobody_took_over_is_still_the_holders(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(1), now=T0)
    (item,) = store.claim_items(job_id, "paused", 1, now=T0, lease_s=10)
    assert store.renew_leases(job_id, "paused", lease_s=10, now=T0 + timedelta(seconds=30)) == 1
    assert store.requeue_expired(job_id, now=T0 + timedelta(seconds=35)) == {}
    assert store.complete_items([ok(item.item_id)], holder="paused") == [item.item_id]


def test_a_store_from_before_leases_gains_the_column_and_its_claims_count_as_expired(store_url: str) -> None:
    with JobStore.open(store_url) as store:
        job_id = store.create_job(SETTINGS, new_items(3), now=T0)
        store.claim_items(job_id, "old-broker", 2, now=T0)
    engine = create_engine(store_url)
    with engine.begin() as conn:  # the items table as a layerbus before leases made it
        conn.execute(text("ALTER TABLE items DROP COLUMN lease_expires_at"))
    engine.dispose()
    with JobStore.open(store_url) as store:
        assert store.job_leases(job_id) == [Lease("old-broker", 2, None)]
        assert store.requeue_expired(job_id, now=T0) == {"old-broker": 2}
        status = store.job_status(job_id)
        assert (status.total, status.queued) == (3, 3)


# --- item counters ------------------------------------------------------------------------------------


def store_job_ids(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(jobs_table.c.id)).scalars())
    finally:
        engine.dispose()


def _counters_and_recount(url: str) -> tuple[dict, dict]:
    """Every job's counters as stored, and as a full count of its items sets them (zero rows dropped)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            job_ids = list(conn.execute(select(jobs_table.c.id)).scalars())
            stored, counted = read_counts(conn, job_ids), recount(conn)
    finally:
        engine.dispose()

    def flat(per_job: dict) -> dict:
        totals = {(job_id, a.status): (a.count, a.ran, a.prompt_tokens, a.completion_tokens)
                  for job_id, aggs in per_job.items() for a in aggs}
        return {key: value for key, value in totals.items() if any(value)}

    return flat(stored), flat(counted)


def _random_writer(url: str, cancel_path: str, seed: int, steps: int, shared_jobs: list[str], errors: list) -> None:
    """One writer: `steps` random claims, completions, failures, requeues, lease expiries, cancels (through
    `cancel_path`) and new jobs, over the shared jobs and its own, on its own connection; what it raises lands
    in `errors`."""
    rng = random.Random(seed)
    jobs, held, clock = list(shared_jobs), [], T0
    try:
        with TwinPathStore.open_twin(url, cancel_path) as store:
            for _ in range(steps):
                clock += timedelta(seconds=rng.random())
                job_id, op = rng.choice(jobs), rng.random()
                if op < 0.05:
                    invalid = [InvalidItem(f"bad-{n}", "x", "refused", 100 + n) for n in range(rng.randint(0, 2))]
                    jobs.append(store.create_job(SETTINGS, new_items(rng.randint(0, 12)), invalid, now=clock))
                elif op < 0.40:
                    worker = rng.choice(["w1", "w2"]) + str(seed)
                    claimed = store.claim_items(job_id, worker, rng.randint(1, 6), now=clock,
                                                lease_s=rng.choice([0.5, 30.0]))
                    held += [(c.item_id, worker) for c in claimed]
                elif op < 0.70 and held:
                    done = [held.pop(rng.randrange(len(held))) for _ in range(min(len(held), rng.randint(1, 4)))]
                    results = [ItemResult(i, None, "error", 2, 0, 0.1, error="boom") if rng.random() < 0.3
                               else ok(i, rng.randint(0, 9)) for i, _ in done]
                    store.complete_items(results, now=clock, holder=rng.choice([done[0][1], None]))
                elif op < 0.80 and held:
                    store.requeue_items([held.pop()[0]], now=clock)
                elif op < 0.90:
                    store.requeue_expired(job_id, now=clock + timedelta(seconds=rng.choice([0, 1, 60])))
                elif op < 0.93:
                    store.requeue_in_flight(job_id, now=clock)
                elif op < 0.96:
                    try:
                        store.cancel_job(job_id, now=clock)
                    except StoreError:  # finished or failed jobs cannot be cancelled
                        pass
                else:
                    try:
                        store.set_job_status(job_id, rng.choice(["failed", "finalizing"]), now=clock)
                    except StoreError:  # a move the lifecycle forbids from where the job is
                        pass
    except Exception as exc:  # noqa: BLE001 (handed to the test thread, which fails with it)
        errors.append(exc)


@CANCEL_PATHS
def test_item_counters_equal_a_full_count_after_two_random_writers(store: JobStore, store_url: str) -> None:
    shared = [store.create_job(SETTINGS, new_items(n), [InvalidItem("bad", "x", "refused", 99)], now=T0)
              for n in (20, 40, 60)]
    errors: list = []
    writers = [threading.Thread(target=_random_writer, args=(store_url, store.cancel_path, seed, 250, shared, errors))
               for seed in (1, 2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert not errors, errors
    stored, counted = _counters_and_recount(store_url)
    assert stored == counted
    assert {state for _, state in counted} >= {"queued", "completed", "failed"}, "the run was too tame"
    # A cancel leaves its queued rows (and counters) as they are; status reports them as cancelled.
    reported = [store.job_status(job_id) for job_id in store_job_ids(store_url)]
    assert any(s.cancelled for s in reported), "the run was too tame: no cancelled item"
    for status in reported:
        assert status.queued + status.in_progress + status.completed + status.failed + status.cancelled == status.total
        if status.timestamps["cancelling_at"] is not None:
            assert status.queued == 0, f"{status.job_id}: a cancelled job reports no queued item"


def test_a_store_from_before_the_counters_gains_them_counted_from_its_items(store_url: str) -> None:
    with JobStore.open(store_url) as store:
        running = store.create_job(SETTINGS, new_items(5), [InvalidItem("bad", "x", "refused", 9)], now=T0)
        store.complete_items([ok(c.item_id, 7) for c in store.claim_items(running, "w", 2)])
        store.claim_items(running, "w", 1)
        cancelled = store.create_job(SETTINGS, new_items(3), now=T0)
        store.cancel_job(cancelled)
        expected = {job_id: store.job_status(job_id, now=T0) for job_id in (running, cancelled)}
    engine = create_engine(store_url)
    with engine.begin() as conn:  # the store as a layerbus before the counters left it
        conn.execute(text("DROP TABLE item_counts"))
    engine.dispose()
    with JobStore.open(store_url) as store:
        assert {job_id: store.job_status(job_id, now=T0) for job_id in expected} == expected
    stored, counted = _counters_and_recount(store_url)
    assert stored == counted


@CANCEL_PATHS
def test_a_cancel_leaves_queued_rows_alone_and_they_read_back_cancelled(store: JobStore, store_url: str) -> None:
    job_id = store.create_job(SETTINGS, new_items(4), now=T0)
    (first,) = store.claim_items(job_id, "w", 1)
    assert store.cancel_job(job_id, now=T0) == "cancelling"
    engine = create_engine(store_url)
    with engine.connect() as conn:
        rows = Counter(conn.execute(select(items_table.c.status).where(items_table.c.job_id == job_id)).scalars())
    engine.dispose()
    assert rows == {"queued": 3, "in_progress": 1}, "the cancel rewrote item rows"
    store.set_job_status(job_id, "failed", error="broker lost")  # a cancelling job may still fail
    assert store.requeue_in_flight(job_id) == 0  # ...and its in-flight item is cancelled, not queued again
    assert [(r["custom_id"], r["status"], r["finish_reason"]) for r in store.item_results(job_id)] == [
        (f"id-{n}", "cancelled", "cancelled") for n in range(4)]
    status = store.job_status(job_id)
    assert (status.cancelled, status.queued, status.in_progress) == (4, 0, 0)


def test_a_job_filled_in_chunks_runs_only_once_queued_and_a_discarded_one_leaves_nothing(store, store_url) -> None:
    job_id = store.begin_job(SETTINGS, now=T0)
    store.add_items(job_id, new_items(3), now=T0)
    store.add_items(job_id, new_items(2, start=3), [InvalidItem("bad", "x", "refused", 9)], now=T0)
    assert store.next_runnable_job() is None and store.claim_items(job_id, "w", 5) == []
    status = store.job_status(job_id)
    assert (status.status, status.total, status.queued, status.failed) == ("validating", 6, 5, 1)
    store.set_job_status(job_id, "queued", now=T0)
    assert [c.custom_id for c in store.claim_items(job_id, "w", 9)] == [f"id-{n}" for n in range(5)]
    with pytest.raises(StoreError, match="is in_progress: items are added only while it is validating"):
        store.add_items(job_id, new_items(1, start=7))
    repeated = store.begin_job(SETTINGS, now=T0)
    store.add_items(repeated, new_items(2))
    with pytest.raises(StoreError, match="job not created, nothing was queued"):
        store.add_items(repeated, new_items(1))  # id-0 again, in a later chunk
    assert store.job_status(repeated).total == 2, "the failed chunk left nothing"
    store.discard_job(repeated)
    refused = store.begin_job(SETTINGS, now=T0)
    store.add_items(refused, new_items(4), now=T0)
    store.discard_job(refused)
    assert [s.job_id for s in store.list_jobs()] == [job_id]
    stored, counted = _counters_and_recount(store_url)
    assert stored == counted and {job for job, _ in stored} == {job_id}
