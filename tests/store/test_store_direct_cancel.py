"""The light commands' direct path (storage/direct_db.py: sqlite3, libpq or psycopg, no SQLAlchemy) agrees
with JobStore, on a SQLite file and on a real PostgreSQL database (through libpq, and through psycopg where
libpq cannot be loaded): a cancel through each leaves twin jobs alike, every read answers alike
(tests/helpers/fixtures_stores.py's TwinPathStore compares them), and what the direct path declines is left to the
full store."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from layerbus.storage.direct_cancel import cancel_job_directly
from layerbus.storage.direct_db import direct_db
from layerbus.storage.direct_status import read_job_status
from layerbus.storage.errors import StoreError
from layerbus.storage.records import ItemResult, JobSettings, NewItem
from layerbus.storage.store import JobStore
from tests.helpers.fixtures_stores import TwinPathStore

T0 = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
SETTINGS = JobSettings(task="generate", model="tiny-model", max_new_tokens=16, name="twin")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("postgres-psycopg", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    url = request.getfixturevalue("postgres_fresh_url")
    if request.param == "postgres-psycopg":  # a machine where libpq cannot be loaded by name
        monkeypatch.setattr("layerbus.storage.libpq.load_libpq", lambda: None)
        assert direct_db(url).driver == "psycopg"
    else:
        assert direct_db(url).driver == "libpq", "psycopg's binary wheel bundles libpq: the light path must find it"
    return url


def items(n: int) -> list[NewItem]:
    return [NewItem(f"id-{i}", f"text {i}", f"prompt {i}", {}, i) for i in range(n)]


def twin_jobs(store: JobStore, scenario: str) -> tuple[str, str]:
    """Two jobs brought to the same state by the same calls: one for each cancel path."""
    ids = []
    for _ in range(2):
        if scenario == "validating":
            job_id = store.begin_job(SETTINGS, now=T0)
            store.add_items(job_id, items(3), now=T0)
        else:
            job_id = store.create_job(SETTINGS, items(6), now=T0)
        if scenario in ("in_flight", "all_finished", "completed"):
            claimed = store.claim_items(job_id, "w", 6 if scenario != "in_flight" else 3, now=T0)
            finished = claimed if scenario != "in_flight" else claimed[:1]
            store.complete_items([ItemResult(c.item_id, "out", "stop", 3, 4, 0.5) for c in finished],
                                 now=T0 + timedelta(seconds=1))
        if scenario == "completed":
            store.set_job_status(job_id, "finalizing", now=T0 + timedelta(seconds=2))
            store.set_job_status(job_id, "completed", now=T0 + timedelta(seconds=3))
        if scenario == "cancelled_before":
            store.cancel_job(job_id, now=T0 + timedelta(seconds=1))
        ids.append(job_id)
    return ids[0], ids[1]


@pytest.mark.parametrize("scenario", ["queued", "validating", "in_flight", "all_finished", "cancelled_before"])
def test_direct_cancel_leaves_the_job_as_the_store_does(store_url: str, scenario: str) -> None:
    with JobStore.open(store_url) as store:
        direct, full = twin_jobs(store, scenario)
        at = T0 + timedelta(minutes=1)
        assert cancel_job_directly(store_url, direct, now=at) == store.cancel_job(full, now=at)
        later = T0 + timedelta(minutes=2)
        assert replace(store.job_status(direct, later), job_id=full) == store.job_status(full, later)
        # What claims and results see of the queued rows depends on cancelling_at alone.
        assert store.claim_items(direct, "w", 10, now=later) == store.claim_items(full, "w", 10, now=later) == []
        assert list(store.item_results(direct)) == list(store.item_results(full))
        # The stored timestamps read back equal (SQLite: the same text format as SQLAlchemy writes, or this
        # comparison and the ordering of text timestamps would break).
        status = store.job_status(direct, later)
        if scenario != "cancelled_before":
            assert status.timestamps["cancelling_at"] == at


def test_direct_cancel_stores_sqlite_timestamps_as_the_full_store_does(tmp_path: Path) -> None:
    import sqlite3

    url = f"sqlite:///{tmp_path / 'store.db'}"
    with JobStore.open(url) as store:
        direct, full = twin_jobs(store, "queued")
        cancel_job_directly(url, direct, now=T0)
        store.cancel_job(full, now=T0)
    with sqlite3.connect(tmp_path / "store.db") as conn:
        rows = {job_id: stamps for job_id, *stamps in conn.execute(
            "SELECT id, created_at, cancelling_at, cancelled_at FROM jobs")}
    # created_at went through SQLAlchemy's UtcDateTime; the cancel's stamps through the driver, as text.
    assert rows[direct] == rows[full] == ["2030-01-02 03:04:05.678901"] * 3


def test_direct_cancel_declines_what_the_full_store_must_word(store_url: str) -> None:
    with JobStore.open(store_url) as store:
        finished, _ = twin_jobs(store, "completed")
        assert cancel_job_directly(store_url, finished) is None
        with pytest.raises(StoreError, match="only validating, queued, in_progress jobs can be cancelled"):
            store.cancel_job(finished)
        assert store.job_status(finished).status == "completed", "declining changed nothing"
        assert cancel_job_directly(store_url, "job_000000000000") is None


def test_direct_cancel_declines_urls_it_does_not_take(tmp_path: Path) -> None:
    assert cancel_job_directly(f"sqlite:///{tmp_path / 'absent.db'}", "job_x") is None
    assert not (tmp_path / "absent.db").exists(), "the direct path creates no store"
    assert direct_db("postgresql://u@h/db") is None, "SQLAlchemy reads that as psycopg2: the full store decides"
    assert direct_db("mysql://u@h/db") is None


def test_direct_reads_match_the_store(store_url: str) -> None:
    with TwinPathStore.open_twin(store_url) as store:  # each read below is made through both paths and compared
        ids = [twin_jobs(store, scenario)[0] for scenario in ("queued", "in_flight", "completed", "cancelled_before")]
        store.add_job_event(ids[1], "stage_lost", "stage stage-1 lost", now=T0 + timedelta(seconds=5))
        store.add_job_event(ids[1], "recovered", "decoding again", 2.5, now=T0 + timedelta(seconds=7))
        store.register_worker(ids[1], "box-a:11:aa", "box-a", "stage-0 [0, 2)", now=T0)
        store.renew_leases(ids[1], "box-a:11:aa", now=T0 + timedelta(seconds=3))
        now = T0 + timedelta(minutes=3)
        for job_id in ids:
            store.job_status(job_id, now)
            store.job_events(job_id)
            store.job_workers(job_id)
            store.stage_snapshots(job_id)
        assert len(store.job_events(ids[1])) == 2 and len(store.job_workers(ids[1])) == 1
        assert len(store.list_jobs(5, now)) == 5
        assert store.latest_job_id("cancelled") is not None
    assert read_job_status(store_url, "job_missing", now) is None  # the full store words the error


def test_an_unreachable_server_is_worded_as_the_full_store_words_it() -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"postgresql+psycopg://layerbus:secret@127.0.0.1:{port}/nowhere"
    with pytest.raises(StoreError) as direct:
        read_job_status(url, "job_x")
    with pytest.raises(StoreError) as full:
        JobStore.open(url)
    assert str(direct.value).split(":")[0] == str(full.value).split(":")[0] == "cannot connect to 'postgresql+psycopg"
    assert "secret" not in str(direct.value) and "check that the server is running" in str(direct.value)


LIGHT_RUN = """
import json, sys
from layerbus.cli.main import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exit:
    code = exit.code
heavy = [m for m in ("sqlalchemy", "pyarrow", "torch", "transformers", "psycopg") if m in sys.modules]
print("RESULT " + json.dumps([code, heavy]))
"""


def test_light_commands_import_no_sqlalchemy_nor_pyarrow(store_url: str, tmp_path: Path) -> None:
    """status, status JOB, results JOB (no file yet), top JOB --once and cancel JOB answer through the driver alone
    (on PostgreSQL libpq, not psycopg, whose import alone costs more than such a command may take)."""
    import json
    import subprocess
    import sys

    with JobStore.open(store_url) as store:
        job_id = store.create_job(SETTINGS, items(3), now=T0)
    env = {"LAYERBUS_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    for args, exit_code in ((["status"], 0), (["status", job_id], 0), (["results", job_id], 1),
                            (["top", job_id, "--once"], 0), (["cancel", job_id], 0),
                            (["status", job_id, "--json"], 0)):
        done = subprocess.run([sys.executable, "-c", LIGHT_RUN, json.dumps([*args, "--db", store_url])],
                              capture_output=True, text=True, env=env, timeout=120)
        code, heavy = json.loads(done.stdout.splitlines()[-1].removeprefix("RESULT "))
        assert (code, heavy) == (exit_code, []), f"layerbus {' '.join(args)}: {done.stdout}{done.stderr}"
    assert '"status": "cancelled"' in done.stdout
