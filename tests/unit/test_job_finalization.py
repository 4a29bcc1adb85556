"""Several brokers on one job, in one process (jobs/runner.py, jobs/finalization.py): each run_job is one
broker (its own worker name and scripted pipeline), on one real SQLite store. Exactly one finalizes; the
others wait for it, or take over from a finalizer that is gone."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

from layerbus.jobs.leases import LeaseConfig
from layerbus.jobs.runner import run_job
from layerbus.storage import JobStore
from layerbus.storage.results import ResultWriter
from tests.helpers.fixtures_jobs import tokenizer  # noqa: F401 - fixture
from tests.helpers.scripted_broker import ScriptedBroker, final_rows, queue_job
from tests.helpers.store_items import ok


@pytest.fixture
def store(tmp_path):
    with JobStore.open(f"sqlite:///{tmp_path / 'jobs.db'}") as opened:
        yield opened


class SlowBroker(ScriptedBroker):
    """A scripted broker that takes a while per batch, so brokers running side by side interleave."""

    def run(self, source, sink, should_stop, events=None):
        def slowed(limit):
            time.sleep(0.005)
            return fetch(limit)

        fetch, source.fetch = source.fetch, slowed
        return super().run(source, sink, should_stop, events)


def test_three_brokers_on_one_job_share_the_work_and_exactly_one_finalizes(store, tokenizer, tmp_path, monkeypatch):
    job_id = queue_job(store, 300)
    names = [f"box:{n}:0{n}" for n in (1, 2, 3)]
    brokers = {name: SlowBroker(tokenizer, batch=4) for name in names}
    statuses = {}
    finalizers = []
    finalize = ResultWriter.finalize

    def counted(writer, *args, **kwargs):
        finalizers.append(writer.parts_dir.name)
        return finalize(writer, *args, **kwargs)

    monkeypatch.setattr(ResultWriter, "finalize", counted)

    def work(name):
        statuses[name] = run_job(store, job_id, brokers[name], tmp_path / "results", poll_cancel_s=0,
                                 worker_name=name, leases=LeaseConfig(lease_s=30))

    threads = [threading.Thread(target=work, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    assert {name: status.status for name, status in statuses.items()} == dict.fromkeys(names, "completed")
    rows = final_rows(store.job_status(job_id).results_path)
    assert Counter(r["custom_id"] for r in rows) == Counter(f"doc-{i}" for i in range(300)), "each once"
    asked = Counter(int(r.request_id) for broker in brokers.values() for r in broker.requests)
    assert len(asked) == 300 and set(asked.values()) == {1}, "no item ran twice"
    workers = {w.worker: w for w in store.job_workers(job_id)}
    assert sum(w.items_done for w in workers.values()) == 300
    assert all(workers[name].items_done > 0 for name in names), {n: w.items_done for n, w in workers.items()}
    assert {w.state for w in workers.values()} == {"stopped"}
    assert len(finalizers) == 1, f"the final file was built by {finalizers}"
    assert finalizers[0] == store.job_finalization(job_id).holder.replace(":", "-")
    assert not (tmp_path / "results" / job_id).exists(), "no broker's parts are left"


def test_a_broker_waits_while_another_finalizes_and_ends_with_the_job(store, tokenizer, tmp_path):
    job_id = queue_job(store, 4)
    other = "other-host:7:ee"  # alive, elsewhere: only its hold tells
    claimed = store.claim_items(job_id, other, 4)
    store.complete_items([ok(c.item_id) for c in claimed], holder=other)
    assert store.claim_finalization(job_id, other, 30).claimed

    def finish_later():
        time.sleep(1.0)
        store.finish_finalization(job_id, other, "/elsewhere/final.parquet", "completed")

    finisher = threading.Thread(target=finish_later)
    finisher.start()
    status = run_job(store, job_id, ScriptedBroker(tokenizer), tmp_path, poll_cancel_s=0, worker_name="box:1:01",
                     leases=LeaseConfig(lease_s=1))
    finisher.join()
    assert (status.status, status.results_path) == ("completed", "/elsewhere/final.parquet"), "the other's file"
    assert store.job_finalization(job_id).holder == other


def test_a_finalizer_whose_hold_ran_out_is_taken_over(store, tokenizer, tmp_path):
    job_id = queue_job(store, 5)
    dead = "gone-host:9:dd"
    claimed = store.claim_items(job_id, dead, 5)
    store.complete_items([ok(c.item_id) for c in claimed], holder=dead)
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=5)
    assert store.claim_finalization(job_id, dead, 60, now=long_ago).claimed  # then killed mid-write

    status = run_job(store, job_id, ScriptedBroker(tokenizer), tmp_path, poll_cancel_s=0, worker_name="box:2:02")

    assert status.status == "completed" and store.job_finalization(job_id).holder == "box:2:02"
    assert sorted(r["custom_id"] for r in final_rows(status.results_path)) == [f"doc-{i}" for i in range(5)]


def test_a_broker_that_breaks_while_another_finalizes_does_not_fail_the_job(store, tokenizer, tmp_path):
    job_id = queue_job(store, 3)
    other = "other-host:7:ee"
    store.complete_items([ok(c.item_id) for c in store.claim_items(job_id, other, 3)], holder=other)
    assert store.claim_finalization(job_id, other, 30).claimed

    class BreakingBroker(ScriptedBroker):
        def keep_alive(self, seconds, report=None, should_stop=None):
            raise RuntimeError("every stage of this broker is gone")

    status = run_job(store, job_id, BreakingBroker(tokenizer), tmp_path, poll_cancel_s=0, worker_name="box:3:03")

    assert status.status == "finalizing" and status.error is None, "the other broker finishes it"
    assert store.finish_finalization(job_id, other, "/elsewhere/final.parquet", "completed")
    (me,) = [w for w in store.job_workers(job_id) if w.worker == "box:3:03"]
    assert me.state == "stopped"


class StrandedBroker(ScriptedBroker):
    """Loses a stage while it waits for the other broker's last items, and the rest cannot hold the model:
    its keep_alive waits for a stage to register (reporting so, as Broker.recover does) until told to stop."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.stopped_waiting = False

    def keep_alive(self, seconds, report=None, should_stop=lambda: False):
        report("stage_lost", "stage stage-1 lost: no heartbeat for 5.0 s", stage="stage-1")
        report("waiting", "the stages left cannot hold tiny (needs 2 MiB, has 1 MiB); waiting for a stage")
        deadline = time.monotonic() + 30
        while not should_stop():
            assert time.monotonic() < deadline, "never told to stop waiting: a chain idle at the job's end hangs"
            time.sleep(0.05)
        self.stopped_waiting = True


def test_a_broker_that_breaks_while_others_hold_the_last_items_leaves_the_job_to_them(store, tokenizer, tmp_path):
    """Nothing queued, every item with another broker: this broker waits, keeping its stages alive. It loses
    a stage there that it cannot do without: it waits one lease for a stage, then leaves the job to the other
    (a worker_left event), instead of waiting for ever while the other finishes the job."""
    job_id = queue_job(store, 3)
    other = "other-host:7:ee"
    assert len(store.claim_items(job_id, other, 3, lease_s=3600)) == 3
    store.register_worker(job_id, other, "other-host", "stage-9 [0, 4)", lease_s=3600)
    broker = StrandedBroker(tokenizer)

    status = run_job(store, job_id, broker, tmp_path, poll_cancel_s=0, worker_name="box:3:03",
                     leases=LeaseConfig(lease_s=1.0))

    assert broker.stopped_waiting and status.status == "in_progress" and status.error is None
    left = [event.message for event in store.job_events(job_id) if event.kind == "worker_left"]
    assert len(left) == 1 and "box:3:03 left the job" in left[0] and other in left[0], left
    assert status.in_progress == 3, "the other broker's items stay its own"
