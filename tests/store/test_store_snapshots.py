"""Stage snapshots (what each broker last saw of a job's stages, for `layerbus top`): the JobStore contract on
SQLite and PostgreSQL, the standard-library read path, and stores made before the table existed."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import delete, text

from layerbus.storage.engine import open_engine
from layerbus.storage.errors import StoreError
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.snapshot_records import StageSnapshot
from layerbus.storage.direct_status import read_latest_job_ids, read_stage_snapshots
from layerbus.storage.store import JobStore
from tests.helpers.fixtures_stores import store, store_url  # noqa: F401 - fixtures
from tests.helpers.store_items import SETTINGS, T0, new_items

BROKER = "box-a:4242:0a1b2c3d"


def snapshot(name: str, position: int | None, **changes) -> StageSnapshot:
    fields = dict(stage=name, position=position, host="box-a", device="cuda:0", layer_start=None, layer_end=None,
                  weights="int4 (q4_1 g32)", wire="int8", state="ready", busy_ratio=0.93, step_s=0.0124,
                  steps=812, tokens=9000, rss_bytes=None, peak_rss_bytes=412 << 20, memory_budget_bytes=6 << 30,
                  bytes_out=3_000_000_000_000, bytes_in=None, out_bytes_per_s=2.1e6, in_bytes_per_s=None,
                  heartbeat_age_s=0.31)
    if position is not None:
        fields.update(layer_start=position * 15, layer_end=position * 15 + 15)
    return StageSnapshot(**{**fields, **changes})


def written(snapshots: list[StageSnapshot], broker: str, at) -> list[StageSnapshot]:
    return [replace(s, broker=broker, updated_at=at) for s in snapshots]


def test_a_broker_replaces_its_own_rows_and_readers_get_them_in_chain_order(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(2), now=T0)
    spare = snapshot("spare", None, state="spare", weights=None, wire=None, busy_ratio=None, step_s=None)
    chain = [snapshot("stage-b", 1, wire=None), snapshot("stage-a", 0)]
    store.record_stage_snapshots(job_id, BROKER, [spare, *chain], now=T0)

    assert store.stage_snapshots(job_id) == written([chain[1], chain[0], spare], BROKER, T0)

    later = [snapshot("stage-a", 0, busy_ratio=0.5, steps=900)]  # stage-b and the spare left the cluster
    store.record_stage_snapshots(job_id, BROKER, later, now=T0 + timedelta(seconds=2))
    assert store.stage_snapshots(job_id) == written(later, BROKER, T0 + timedelta(seconds=2))


def test_each_broker_keeps_its_own_rows_and_jobs_are_apart(store: JobStore) -> None:
    job_id = store.create_job(SETTINGS, new_items(2), now=T0)
    other_job = store.create_job(SETTINGS, new_items(1), now=T0)
    store.record_stage_snapshots(job_id, "box-b:1:ff", [snapshot("b0", 0)], now=T0)
    store.record_stage_snapshots(job_id, BROKER, [snapshot("a0", 0)], now=T0 + timedelta(seconds=1))
    store.record_stage_snapshots(other_job, BROKER, [snapshot("x", 0)], now=T0)

    assert [(s.broker, s.stage) for s in store.stage_snapshots(job_id)] == [(BROKER, "a0"), ("box-b:1:ff", "b0")]
    store.record_stage_snapshots(job_id, BROKER, [], now=T0 + timedelta(seconds=3))
    assert [(s.broker, s.stage) for s in store.stage_snapshots(job_id)] == [("box-b:1:ff", "b0")]
    assert [s.stage for s in store.stage_snapshots(other_job)] == ["x"]
    assert store.stage_snapshots(store.create_job(SETTINGS, new_items(1))) == []


def test_unknown_job_is_a_store_error_naming_it(store: JobStore) -> None:
    with pytest.raises(StoreError, match="no job 'job_missing'"):
        store.record_stage_snapshots("job_missing", BROKER, [snapshot("a", 0)])
    with pytest.raises(StoreError, match="no job 'job_missing'"):
        store.stage_snapshots("job_missing")


def test_deleting_a_job_deletes_its_snapshots(store: JobStore, store_url: str) -> None:
    job_id = store.create_job(SETTINGS, new_items(1), now=T0)
    store.record_stage_snapshots(job_id, BROKER, [snapshot("a", 0)], now=T0)
    engine = open_engine(store_url)
    with engine.begin() as conn:
        conn.execute(delete(jobs_table).where(jobs_table.c.id == job_id))
        assert conn.execute(text("SELECT count(*) FROM stage_snapshots")).scalar_one() == 0
    engine.dispose()


def test_latest_job_id_of_a_state(store: JobStore) -> None:
    running = store.create_job(SETTINGS, new_items(1), now=T0)
    store.claim_items(running, "w", 1, now=T0)
    newest = store.create_job(SETTINGS, new_items(1), now=T0 + timedelta(seconds=1))
    assert store.latest_job_id() == newest
    assert store.latest_job_id("in_progress") == running
    assert store.latest_job_id("failed") is None


def test_a_store_made_before_stage_snapshots_gains_the_table_on_open(store_url: str) -> None:
    with JobStore.open(store_url) as old:
        job_id = old.create_job(SETTINGS, new_items(1), now=T0)
    engine = open_engine(store_url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE stage_snapshots"))
    engine.dispose()
    with JobStore.open(store_url) as reopened:
        assert reopened.stage_snapshots(job_id) == []
        reopened.record_stage_snapshots(job_id, BROKER, [snapshot("a", 0)], now=T0)
        assert [s.stage for s in reopened.stage_snapshots(job_id)] == ["a"]


# --- the standard-library path that `layerbus top` reads a SQLite file with ---------------------------


def test_sqlite_path_reads_snapshots_like_the_store_and_tolerates_old_stores(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    with JobStore.open(url) as store:
        job_id = store.create_job(SETTINGS, new_items(2), now=T0)
        store.claim_items(job_id, "w", 1, now=T0)
        newer = store.create_job(SETTINGS, new_items(1), now=T0 + timedelta(seconds=5))
        store.record_stage_snapshots(job_id, "box-b:1:ff", [snapshot("b0", 0)], now=T0)
        store.record_stage_snapshots(job_id, BROKER, [snapshot("spare", None), snapshot("a1", 1), snapshot("a0", 0)],
                                     now=T0 + timedelta(microseconds=123456))
        expected = store.stage_snapshots(job_id)
    assert [s.stage for s in expected] == ["a0", "a1", "spare", "b0"]
    assert read_stage_snapshots(url, job_id) == expected
    assert read_stage_snapshots(url, "job_missing") == []
    assert read_stage_snapshots("postgresql://u@h/db", job_id) is None  # psycopg2 per SQLAlchemy: not taken
    assert read_stage_snapshots(f"sqlite:///{tmp_path / 'absent.db'}", job_id) is None
    assert read_latest_job_ids(url) == [newer]
    assert read_latest_job_ids(url, "in_progress") == [job_id]
    assert read_latest_job_ids(url, "failed") == []
    assert read_latest_job_ids("postgresql://u@h/db") is None

    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        conn.execute("DROP TABLE stage_snapshots")
    assert read_stage_snapshots(url, job_id) == []
