"""A long document's parts in the store: the item made from them waits, and the transaction that finishes its
last part moves it (a reduce queued, a join completed, a failure passed up), once, on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlite3
import threading

from layerbus.storage.item_counts import read_counts, recount
from layerbus.storage.records import ItemResult, NewItem
from layerbus.storage.store import JobStore
from tests.helpers.fixtures_stores import store, store_url  # noqa: F401 - fixtures
from tests.helpers.store_items import SETTINGS, T0, new_items, ok

W = "box-a:11:aa"


def piece(doc: str, position: int, parent: str | None = None, seq: int = 0, join_before: str = "\n\n",
          level: int = 0, combine: str | None = None) -> NewItem:
    params = {"join_before": join_before} if position else {}
    return NewItem(f"{doc}#{level}-{position}", "", None if combine else f"piece {position}", params,
                   seq or 1000 + level * 100 + position, parent_id=parent or doc, position=position, level=level,
                   combine=combine)


def document(doc: str, seq: int, combine: str, level: int = 1) -> NewItem:
    return NewItem(doc, f"the whole {doc}", None, {}, seq, level=level, combine=combine)


def counters_agree(store: JobStore, job_id: str) -> None:
    with store._read() as conn:
        stored = {a.status: a.count for a in read_counts(conn, [job_id])[job_id] if a.count}
        counted = {a.status: a.count for a in recount(conn, [job_id]).get(job_id, [])}
    assert stored == counted


def by_id(store: JobStore, job_id: str, limit: int = 50) -> dict:
    return {item.custom_id: item for item in store.claim_items(job_id, W, limit, now=T0)}


def test_a_reduce_waits_for_its_last_piece_then_runs_and_is_the_documents_one_result(store: JobStore) -> None:
    items = [*new_items(1), document("doc", 2, "reduce"), *(piece("doc", i) for i in range(3))]
    job_id = store.create_job(SETTINGS, items, now=T0)
    assert store.job_status(job_id).counts["waiting"] == 1
    claimed = by_id(store, job_id)
    assert set(claimed) == {"id-0", "doc#0-0", "doc#0-1", "doc#0-2"}, "a waiting item is never claimed"
    assert claimed["doc#0-1"].parent_id == "doc"
    store.complete_items([ok(claimed[name].item_id) for name in ("id-0", "doc#0-2", "doc#0-0")], now=T0, holder=W)
    assert by_id(store, job_id) == {} and store.job_status(job_id).counts["waiting"] == 1
    store.complete_items([ok(claimed["doc#0-1"].item_id)], now=T0, holder=W)
    status = store.job_status(job_id)
    assert (status.queued, status.counts["waiting"]) == (1, 0)
    [reduce] = store.claim_items(job_id, W, 5, now=T0)
    assert (reduce.custom_id, reduce.combine, reduce.prompt, reduce.input) == ("doc", "reduce", "", "the whole doc")
    store.complete_items([ok(reduce.item_id)], now=T0, holder=W)
    assert [row["custom_id"] for row in store.item_results(job_id)] == ["id-0", "doc"]
    assert store.claim_finalization(job_id, W, 30, now=T0).claimed
    counters_agree(store, job_id)


def test_a_tree_of_reduces_moves_up_level_by_level(store: JobStore) -> None:
    items = [document("doc", 1, "reduce", level=2),
             piece("doc", 0, level=1, combine="reduce"), piece("doc", 1, level=1, combine="reduce"),
             *(piece("doc", i, parent="doc#1-0") for i in range(2)),
             *(piece("doc", i + 2, parent="doc#1-1") for i in range(2))]
    items[-2:] = [NewItem(f"doc#0-{i}", "", f"piece {i}", {}, 1010 + i, parent_id="doc#1-1", position=i - 2, level=0)
                  for i in (2, 3)]
    job_id = store.create_job(SETTINGS, items, now=T0)
    claimed = by_id(store, job_id)
    assert len(claimed) == 4
    store.complete_items([ok(c.item_id) for c in claimed.values()], now=T0, holder=W)
    level_one = by_id(store, job_id)
    assert set(level_one) == {"doc#1-0", "doc#1-1"} and store.job_status(job_id).counts["waiting"] == 1
    store.complete_items([ok(c.item_id) for c in level_one.values()], now=T0, holder=W)
    assert set(by_id(store, job_id)) == {"doc"}
    counters_agree(store, job_id)


def test_a_join_completes_with_its_pieces_in_order_without_a_model_call(store: JobStore) -> None:
    items = [document("doc", 1, "join"), piece("doc", 0), piece("doc", 1, join_before=" "), piece("doc", 2)]
    job_id = store.create_job(SETTINGS, items, now=T0)
    claimed = by_id(store, job_id)
    for name in ("doc#0-2", "doc#0-0", "doc#0-1"):  # finished out of order
        result = ItemResult(claimed[name].item_id, f"<{name[-1]}>", "length" if name.endswith("1") else "stop",
                            prompt_tokens=3, completion_tokens=2, latency_s=0.1)
        store.complete_items([result], now=T0, holder=W)
    [row] = store.item_results(job_id)
    assert (row["custom_id"], row["output"], row["status"], row["finish_reason"]) == (
        "doc", "<0> <1>\n\n<2>", "completed", "length")
    counters_agree(store, job_id)


def test_a_failed_piece_fails_its_document_and_the_job_still_ends(store: JobStore) -> None:
    items = [document("doc", 1, "join"), piece("doc", 0), piece("doc", 1)]
    job_id = store.create_job(SETTINGS, items, now=T0)
    claimed = by_id(store, job_id)
    failed = ItemResult(claimed["doc#0-1"].item_id, None, "error", 0, 0, 0.1, error="stage crashed")
    store.complete_items([ok(claimed["doc#0-0"].item_id), failed], now=T0, holder=W)
    [row] = store.item_results(job_id)
    assert (row["status"], row["error"]) == ("failed", "part 2 of 2 failed: stage crashed")
    assert store.claim_finalization(job_id, W, 30, now=T0).claimed
    counters_agree(store, job_id)


def test_a_cancelled_jobs_waiting_document_is_reported_cancelled(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, [document("doc", 1, "reduce"), piece("doc", 0), piece("doc", 1)], now=T0)
    store.cancel_job(job_id, now=T0)
    [row] = store.item_results(job_id)
    assert (row["custom_id"], row["status"]) == ("doc", "cancelled")
    assert store.job_status(job_id).counts["waiting"] == 0


def test_two_writers_finishing_the_last_two_pieces_at_once_queue_the_reduce_once(store_url: str) -> None:
    for round_ in range(6):
        with JobStore.open(store_url) as setup:
            job_id = setup.create_job(SETTINGS, [document("doc", 1, "reduce"), piece("doc", 0), piece("doc", 1)],
                                      now=T0)
            claimed = list(by_id(setup, job_id).values())
        barrier = threading.Barrier(2)

        def finish(item_id: int) -> None:
            with JobStore.open(store_url) as mine:
                barrier.wait()
                mine.complete_items([ok(item_id)], now=T0, holder=W)

        threads = [threading.Thread(target=finish, args=(c.item_id,)) for c in claimed]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with JobStore.open(store_url) as check:
            status = check.job_status(job_id)
            assert (status.queued, status.counts["waiting"]) == (1, 0), f"round {round_}"
            counters_agree(check, job_id)


def test_an_older_sqlite_store_admits_the_waiting_state_when_opened(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    JobStore.open(url).close()
    with sqlite3.connect(tmp_path / "old.db") as conn:  # as a layerbus before long documents left it
        conn.execute("DROP INDEX items_job_parent")
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_master SET sql = replace(sql, ', ''waiting''', '') WHERE name = 'items'")
        version = conn.execute("PRAGMA schema_version").fetchone()[0]
        conn.execute(f"PRAGMA schema_version = {version + 1}")
    with sqlite3.connect(tmp_path / "old.db") as conn:
        assert "'waiting'" not in conn.execute("SELECT sql FROM sqlite_master WHERE name = 'items'").fetchone()[0]
    with JobStore.open(url) as store:
        job_id = store.create_job(SETTINGS, [document("doc", 1, "join"), piece("doc", 0)], now=T0)
        assert store.job_status(job_id).counts["waiting"] == 1
    with sqlite3.connect(tmp_path / "old.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_streamed_submit_stores_parts_beside_plain_items_and_counts_them(store: JobStore) -> None:
    job_id = store.begin_job(SETTINGS, now=T0)
    store.add_items(job_id, [*new_items(2), document("doc", 5, "join")], now=T0)
    store.add_items(job_id, [piece("doc", 0), piece("doc", 1)], now=T0)
    store.set_job_status(job_id, "queued", now=T0)
    status = store.job_status(job_id)
    assert (status.total, status.queued, status.counts["waiting"]) == (5, 4, 1)
    assert store.document_progress(job_id).parts == 2
    counters_agree(store, job_id)
