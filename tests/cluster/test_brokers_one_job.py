"""Several `layerbus run --job JOB` brokers on one job, each with its own local stage, sharing one results
folder, on a SQLite file and on a PostgreSQL database (real processes): every custom_id exactly once in the
final file, outputs identical to a single broker's run, every broker did work, exactly one finalized.
And `kill -9` of one broker mid-job: the other takes its items over once their lease runs out.

Every broker must get work, however their start-ups are spread: before they start, a ghost holder (a
broker elsewhere, alive as far as anyone can tell) holds every item, so each broker that comes up waits;
once all of them are registered on the job the ghost's items go back to the queue, and all claim at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from layerbus.storage import JobStore
from tests.helpers.cli import (assert_parquet_matches_store, cli_env, layerbus, layerbus_executable, result_outputs,
                               run_outputs, status_json, write_jsonl)
from tests.helpers.fixtures_cli import model  # noqa: F401 - fixture
from tests.helpers.processes import descendants, logs_of, wait_until
from tests.helpers.store_items import GHOST

# 2,000 items; each broker runs one stage on one thread.
ITEMS = 2000
JOB_ARGS = ("--task", "summarize", "--max-new-tokens", "6")
RUN_ARGS = ("--stages", "1", "--threads-per-stage", "1", "--max-context", "128", "--slots", "32")
# A short lease, so a killed broker's items come back within seconds (renewed every 0.5 s).
LEASE_S = 6
TIMEOUT_S = 300


def documents() -> list[dict]:
    return [{"id": f"doc-{i:04d}", "text": f"Broker {i % 3} takes batch {i}; {i % 11} stages pass it on."}
            for i in range(ITEMS)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", documents())


@pytest.fixture(scope="module")
def single_broker_outputs(tmp_path_factory, corpus, model) -> dict[str, str]:
    """The outputs of one broker running the whole job: what several brokers must give."""
    return run_outputs(tmp_path_factory.mktemp("single"), corpus, model, *JOB_ARGS, *RUN_ARGS, timeout=TIMEOUT_S)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return request.getfixturevalue("postgres_fresh_url")


def submit(home: Path, corpus: Path, model: Path, db: str) -> str:
    """Queue the job with every item held by the ghost (see the module docstring)."""
    done = layerbus(home, "submit", corpus, "--model", model, "--db", db, *JOB_ARGS)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    with JobStore.open(db) as store:
        assert len(store.claim_items(job_id, GHOST, ITEMS, lease_s=3600)) == ITEMS
    return job_id


def start_brokers(home: Path, job_id: str, db: str, count: int, logs: Path) -> list[subprocess.Popen]:
    logs.mkdir(parents=True, exist_ok=True)
    brokers = []
    for n in range(count):
        with open(logs / f"broker-{n}.log", "w") as log:
            brokers.append(subprocess.Popen(
                [layerbus_executable(), "run", "--job", job_id, "--db", db, "--lease", str(LEASE_S), *RUN_ARGS],
                env=cli_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return brokers


def release_the_ghosts_items(store: JobStore, job_id: str, count: int, brokers, logs: Path) -> dict[int, str]:
    """Wait until `count` brokers work the job, then requeue the ghost's items; pid -> worker name."""
    wait_until(lambda: len(store.job_workers(job_id)) == count, f"{count} brokers on the job", brokers, logs)
    assert store.requeue_expired(job_id, holders=[GHOST]) == {GHOST: ITEMS}
    return {int(worker.worker.split(":")[-2]): worker.worker for worker in store.job_workers(job_id)}


def both_working(store: JobStore, job_id: str, brokers: list[subprocess.Popen], logs: Path) -> dict[int, str]:
    """Two brokers on the job, the ghost's items released, until each has recorded work; pid -> worker name."""
    names = release_the_ghosts_items(store, job_id, 2, brokers, logs)
    working = lambda: all(w.items_done > 0 for w in store.job_workers(job_id))  # noqa: E731
    wait_until(working, "work recorded by both brokers", brokers, logs)
    return names


def stop(brokers: list[subprocess.Popen]) -> None:
    for broker in brokers:
        if broker.poll() is None:
            os.killpg(broker.pid, signal.SIGKILL)
        broker.wait(30)


def assert_each_item_once_with_the_single_brokers_outputs(home: Path, db: str, job_id: str, expected,
                                                          logs: Path | None = None) -> dict:
    if db.startswith("postgresql"):  # its text cannot hold NUL: a generated one is stored as U+FFFD
        expected = {key: output.replace("\x00", "\ufffd") for key, output in expected.items()}
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == ITEMS, \
        f"{status}\n{logs_of(logs) if logs else ''}"
    rows = assert_parquet_matches_store(db, job_id, status["results_path"])
    assert Counter(row["custom_id"] for row in rows) == Counter(list(expected)), "every custom_id exactly once"
    assert result_outputs(status["results_path"]) == expected
    assert not (home / "results" / job_id).exists(), "no broker's part files are left"
    return status


@pytest.mark.parametrize("count", [2, 3])
def test_brokers_on_one_job_share_it_and_give_the_single_brokers_outputs(count, db, tmp_path, corpus, model,
                                                                         single_broker_outputs):
    home, logs = tmp_path / "home", tmp_path / "logs"
    job_id = submit(home, corpus, model, db)
    brokers = start_brokers(home, job_id, db, count, logs)
    try:
        with JobStore.open(db) as store:
            names = release_the_ghosts_items(store, job_id, count, brokers, logs)
        for broker in brokers:
            assert broker.wait(TIMEOUT_S) == 0, logs_of(logs)
    finally:
        stop(brokers)

    status = assert_each_item_once_with_the_single_brokers_outputs(home, db, job_id, single_broker_outputs, logs)
    workers = {worker["worker"]: worker for worker in status["workers"]}
    assert set(workers) == set(names.values())
    done = {name: worker["items_done"] for name, worker in workers.items()}
    print(f"items per broker ({db.split(':')[0]}, {count} brokers): {sorted(done.values())}")
    assert all(items > 0 for items in done.values()) and sum(done.values()) == ITEMS, f"items per broker: {done}"
    assert {worker["state"] for worker in workers.values()} == {"stopped"}
    with JobStore.open(db) as store:
        assert store.job_finalization(job_id).holder in names.values()
        recorded = Counter(row.holder for row in _holders(store, job_id))
    assert recorded == Counter(done), "each broker's count is the items the store says it recorded"


def _holders(store: JobStore, job_id: str):
    """(holder,) of every finished item, from the items themselves."""
    from sqlalchemy import select

    from layerbus.storage.schema import items

    with store._read() as conn:  # noqa: SLF001 (a test reads the raw column the counts must agree with)
        return [type("Row", (), {"holder": row[0]}) for row in
                conn.execute(select(items.c.claimed_by).where(items.c.job_id == job_id))]


def test_kill_9_of_one_broker_mid_job_the_other_finishes_after_its_lease(db, tmp_path, corpus, model,
                                                                       single_broker_outputs):
    home, logs = tmp_path / "home", tmp_path / "logs"
    job_id = submit(home, corpus, model, db)
    brokers = start_brokers(home, job_id, db, 2, logs)
    try:
        with JobStore.open(db) as store:
            names = both_working(store, job_id, brokers, logs)
            victim, survivor = brokers
            os.killpg(victim.pid, signal.SIGKILL)  # the broker and its stage: a machine gone at once
            victim.wait(30)
            held = {lease.holder: lease.items for lease in store.job_leases(job_id)}
            killed_at = store.job_status(job_id)
            assert held.get(names[victim.pid], 0) > 0, f"the killed broker held no items: {held}\n{logs_of(logs)}"
            assert killed_at.completed < ITEMS, f"killed mid-job\n{logs_of(logs)}"
        assert survivor.wait(TIMEOUT_S) == 0, logs_of(logs)
    finally:
        stop(brokers)

    status = assert_each_item_once_with_the_single_brokers_outputs(home, db, job_id, single_broker_outputs,
                                                                   logs)
    # Every failure below says what the store and the brokers said: a rare one must be diagnosable from CI's log.
    seen = f"workers: {status['workers']}\nevents: {status['events']}\n{logs_of(logs)}"
    workers = {worker["worker"]: worker for worker in status["workers"]}
    dead, alive = workers[names[victim.pid]], workers[names[survivor.pid]]
    assert (dead["state"], alive["state"]) == ("lost", "stopped"), seen
    print(f"killed broker recorded {dead['items_done']}, the survivor {alive['items_done']}; "
          f"{held[names[victim.pid]]} item(s) in flight at the kill")
    assert dead["items_done"] + alive["items_done"] == ITEMS, f"nothing recorded twice\n{seen}"
    taken = [event["message"] for event in status["events"] if event["kind"] == "lease_expired"]
    assert taken and all(names[victim.pid] in message for message in taken), seen
    with JobStore.open(db) as store:
        assert store.job_finalization(job_id).holder == names[survivor.pid], seen


def test_kill_9_of_one_brokers_stage_leaves_the_job_to_the_other_broker(tmp_path, corpus, model,
                                                                        single_broker_outputs):
    """Two chains on one job; one chain's only stage is killed mid-job. Its broker cannot re-plan (no stage
    left) and waits for one; beside a working broker it leaves the job after a lease's wait, its items go
    back to the queue, and the other chain finishes the job: every item once, the single broker's outputs.
    (Before, the broker waited for a stage for ever while renewing its items' leases, and the other broker
    waited for those items for ever.)"""
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    home, logs = tmp_path / "home", tmp_path / "logs"
    job_id = submit(home, corpus, model, db)
    brokers = start_brokers(home, job_id, db, 2, logs)
    try:
        with JobStore.open(db) as store:
            names = both_working(store, job_id, brokers, logs)
            stranded, survivor = brokers
            stages = descendants(stranded.pid)
            assert stages, "the broker's stage processes"
            for pid in stages:
                os.kill(pid, signal.SIGKILL)
            assert store.job_status(job_id).completed < ITEMS, "killed mid-job"
            assert stranded.wait(TIMEOUT_S) != 0, "a broker that left its job exits non-zero"
            left = [event["message"] for event in status_json(home, job_id, "--db", db)["events"]
                    if event["kind"] == "worker_left"]
            assert len(left) == 1 and names[stranded.pid] in left[0], logs_of(logs)
        assert survivor.wait(TIMEOUT_S) == 0, logs_of(logs)
    finally:
        stop(brokers)

    status = assert_each_item_once_with_the_single_brokers_outputs(home, db, job_id, single_broker_outputs, logs)
    workers = {worker["worker"]: worker for worker in status["workers"]}
    gone, alive = workers[names[stranded.pid]], workers[names[survivor.pid]]
    print(f"the broker whose stage was killed recorded {gone['items_done']}, the other {alive['items_done']}")
    assert gone["items_done"] + alive["items_done"] == ITEMS, "nothing recorded twice"
    assert gone["state"] == "stopped" and alive["state"] == "stopped"
