"""Job events (what happened to a running job and how long it took): the JobStore contract on SQLite and
PostgreSQL, stores made before the table existed, and what `layerbus status` shows of them."""

from __future__ import annotations

import json
import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import delete, inspect, text

from layerbus.storage.engine import open_engine
from layerbus.storage.errors import StoreError
from layerbus.storage.events import MAX_EVENT_MESSAGE_CHARS
from layerbus.storage.records import JobEvent
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.direct_status import read_job_events, read_job_status
from layerbus.storage.store import JobStore
from tests.helpers.cli import layerbus
from tests.helpers.fixtures_stores import store, store_url  # noqa: F401 - fixtures
from tests.helpers.store_items import SETTINGS, T0, new_items, ok

LOST = "stage stage-1 lost: silent for 5.2 s (liveness window 5 s)"


def test_events_come_back_oldest_first_with_their_fields(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(2), now=T0)
    store.add_job_event(job_id, "stage_lost", LOST, now=T0 + timedelta(seconds=1))
    store.add_job_event(job_id, "replanned", "layers [0, 15) on stage-0, [15, 30) on stage-2",
                        duration_s=0.25, now=T0 + timedelta(seconds=2))
    store.add_job_event(job_id, "recovered", "first new token 2.31 s after the loss", duration_s=2.31,
                        now=T0 + timedelta(seconds=2))  # same time as the one before: insertion order decides
    other = store.create_job(SETTINGS, new_items(1), now=T0)
    store.add_job_event(other, "resumed", "broker restarted", now=T0)

    assert store.job_events(job_id) == [
        JobEvent(T0 + timedelta(seconds=1), "stage_lost", LOST, None),
        JobEvent(T0 + timedelta(seconds=2), "replanned", "layers [0, 15) on stage-0, [15, 30) on stage-2", 0.25),
        JobEvent(T0 + timedelta(seconds=2), "recovered", "first new token 2.31 s after the loss", 2.31),
    ]
    assert store.job_events(other) == [JobEvent(T0, "resumed", "broker restarted", None)]
    assert store.job_events(store.create_job(SETTINGS, new_items(1))) == []


def test_limit_keeps_the_most_recent_events(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(1), now=T0)
    for n in range(7):
        store.add_job_event(job_id, "waiting", f"event {n}", now=T0 + timedelta(seconds=n))
    assert [e.message for e in store.job_events(job_id, limit=3)] == ["event 4", "event 5", "event 6"]
    assert len(store.job_events(job_id)) == 7
    with pytest.raises(ValueError, match="limit=0"):
        store.job_events(job_id, limit=0)


def test_unknown_job_is_a_store_error_naming_it(store: JobStore) -> None:
    with pytest.raises(StoreError, match=r"no job 'job_missing' in .*`layerbus status` lists the jobs"):
        store.add_job_event("job_missing", "stage_lost", LOST)
    with pytest.raises(StoreError, match="no job 'job_missing'"):
        store.job_events("job_missing")


def test_long_messages_are_cut_and_bad_kinds_or_durations_refused(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(1), now=T0)
    store.add_job_event(job_id, "load_failed", "Traceback: " + "x" * 10_000)
    (event,) = store.job_events(job_id)
    assert len(event.message) == MAX_EVENT_MESSAGE_CHARS
    assert event.message.startswith("Traceback: xxx") and event.message.endswith(" [...]")
    with pytest.raises(ValueError, match="kind 'k{33}' must be 1 to 32 characters"):
        store.add_job_event(job_id, "k" * 33, "too long a kind")
    with pytest.raises(ValueError, match="kind '' must be"):
        store.add_job_event(job_id, "", "no kind")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"duration_s=.* must be a finite number >= 0"):
            store.add_job_event(job_id, "recovered", "m", duration_s=bad)
    with pytest.raises(ValueError, match="naive datetime"):
        store.add_job_event(job_id, "recovered", "m", now=T0.replace(tzinfo=None))
    assert len(store.job_events(job_id)) == 1


def test_deleting_a_job_deletes_its_events(store: JobStore, store_url: str) -> None:
    job_id = store.create_job(SETTINGS, new_items(1), now=T0)
    store.add_job_event(job_id, "stage_lost", LOST)
    engine = open_engine(store_url)  # layerbus's connection settings: SQLite enforces foreign keys only with them
    with engine.begin() as conn:
        conn.execute(delete(jobs_table).where(jobs_table.c.id == job_id))
        assert conn.execute(text("SELECT count(*) FROM job_events")).scalar_one() == 0
    engine.dispose()


def test_a_store_made_before_job_events_gains_the_table_on_open(store_url: str) -> None:
    with JobStore.open(store_url) as old:
        job_id = old.create_job(SETTINGS, new_items(2), now=T0)
        old.complete_items([ok(i.item_id) for i in old.claim_items(job_id, "w", 1)])
    engine = open_engine(store_url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE job_events"))  # now shaped like a store from before the table
    engine.dispose()

    with JobStore.open(store_url) as reopened:
        assert reopened.job_events(job_id) == []
        reopened.add_job_event(job_id, "resumed", "broker restarted", now=T0)
        assert reopened.job_events(job_id) == [JobEvent(T0, "resumed", "broker restarted", None)]
        assert reopened.job_status(job_id).completed == 1, "the old rows are untouched"
    engine = open_engine(store_url)
    with engine.connect() as conn:
        assert "job_events_job_id_id" in {index["name"] for index in inspect(conn).get_indexes("job_events")}
    engine.dispose()


# --- the standard-library status path and the CLI (SQLite files) -------------------------------------


def _store_with_events(tmp_path: Path) -> tuple[str, str]:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    with JobStore.open(url) as store:
        job_id = store.create_job(SETTINGS, new_items(3), now=T0)
        store.add_job_event(job_id, "stage_lost", LOST, now=T0 + timedelta(seconds=10))
        store.add_job_event(job_id, "load_failed", "stage-2 could not load [15, 30):\nout of memory",
                            now=T0 + timedelta(seconds=11))
        store.add_job_event(job_id, "recovered", "decoding again on 2 stages", duration_s=2.314,
                            now=T0 + timedelta(seconds=12))
    return url, job_id


def test_sqlite_path_reads_events_like_the_store_and_tolerates_old_stores(tmp_path: Path) -> None:
    url, job_id = _store_with_events(tmp_path)
    with JobStore.open(url) as store:
        for limit in (1, 2, 50):
            assert read_job_events(url, job_id, limit) == store.job_events(job_id, limit)
    assert read_job_events(url, "job_missing") == []
    assert read_job_events("postgresql://u@h/db", job_id) is None  # psycopg2 per SQLAlchemy: not taken
    assert read_job_events(f"sqlite:///{tmp_path / 'absent.db'}", job_id) is None

    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        conn.execute("DROP TABLE job_events")
    assert read_job_events(url, job_id) == [] and read_job_status(url, job_id) is not None


@pytest.mark.cluster
def test_status_shows_events_as_text_and_json(tmp_path: Path) -> None:
    url, job_id = _store_with_events(tmp_path)
    # The plain URL takes the standard-library path; a query string makes `status` use JobStore.
    for db in (url, url + "?timeout=5"):
        report = layerbus(tmp_path, "status", job_id, "--db", db)
        assert report.returncode == 0, report.stderr
        assert report.stdout.endswith(
            "\n\nevents (UTC)\n"
            f"2030-01-02 03:04:15  stage_lost   {LOST}\n"
            "2030-01-02 03:04:16  load_failed  stage-2 could not load [15, 30):\n"
            "                                  out of memory\n"
            "2030-01-02 03:04:17  recovered    decoding again on 2 stages (took 2.31 s)\n"
        ), report.stdout
        as_json = layerbus(tmp_path, "status", job_id, "--db", db, "--json")
        assert as_json.returncode == 0, as_json.stderr
        events = json.loads(as_json.stdout)["events"]
        assert [(e["kind"], e["duration_s"]) for e in events] == [
            ("stage_lost", None), ("load_failed", None), ("recovered", 2.314)]
        assert events[0] == {"at": "2030-01-02T03:04:15.678901+00:00", "kind": "stage_lost", "message": LOST,
                             "duration_s": None}
    listing = json.loads(layerbus(tmp_path, "status", "--db", url, "--json").stdout)
    assert "events" not in listing[0], "the jobs table stays one query"


@pytest.mark.cluster
def test_status_of_a_job_without_events_and_of_an_old_store(tmp_path: Path) -> None:
    url, job_id = _store_with_events(tmp_path)
    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        conn.execute("DROP TABLE job_events")
    report = layerbus(tmp_path, "status", job_id, "--db", url)
    assert report.returncode == 0 and "events" not in report.stdout, report.stdout + report.stderr
    assert json.loads(layerbus(tmp_path, "status", job_id, "--db", url, "--json").stdout)["events"] == []
    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "job_events" not in tables, "the read-only path never writes"


@pytest.mark.cluster
def test_status_watch_shows_events(tmp_path: Path) -> None:
    url, job_id = _store_with_events(tmp_path)
    with JobStore.open(url) as store:
        store.cancel_job(job_id)  # a final state, so --watch prints once and exits
    watched = layerbus(tmp_path, "status", job_id, "--db", url, "--watch", "--json")
    assert watched.returncode == 1, watched.stderr  # 1: the job did not complete
    assert [e["kind"] for e in json.loads(watched.stdout)["events"]] == ["stage_lost", "load_failed", "recovered"]
