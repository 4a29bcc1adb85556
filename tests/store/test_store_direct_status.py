"""The standard-library read path for `layerbus status` agrees with JobStore on a real SQLite file."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from layerbus.storage import InvalidItem, ItemResult, JobSettings, JobStore, NewItem
from layerbus.storage.direct_status import read_job_status, read_recent_jobs, sqlite_file
from tests.helpers.fixtures_stores import TwinPathStore

T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)


def make_store(tmp_path: Path) -> tuple[str, list[str]]:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    with JobStore.open(url) as store:
        ids = []
        for j in range(3):
            items = [NewItem(f"c{i}", f"text {i}", f"prompt {i}", {}, i) for i in range(10)]
            invalid = [InvalidItem("bad", "raw", "missing text", 10)] if j == 1 else []
            ids.append(store.create_job(JobSettings(task="summarize", model="m", name=f"job{j}"), items, invalid,
                                        now=T0 + timedelta(minutes=j)))
        claimed = store.claim_items(ids[0], "w", 6, now=T0 + timedelta(minutes=5))
        store.complete_items([ItemResult(c.item_id, "out", "stop", 7, 3 + k, 0.5, None if k % 3 else "boom")
                              for k, c in enumerate(claimed[:4])], now=T0 + timedelta(minutes=6))
        store.cancel_job(ids[2], now=T0 + timedelta(minutes=7))
        store.add_job_event(ids[0], "stage_lost", "stage stage-1 lost", now=T0 + timedelta(minutes=6, seconds=1))
        store.add_job_event(ids[0], "recovered", "decoding again", 2.5, now=T0 + timedelta(minutes=6, seconds=3))
    return url, ids


def test_sqlite_read_path_matches_the_store(tmp_path):
    url, ids = make_store(tmp_path)
    now = T0 + timedelta(minutes=9)
    with TwinPathStore.open_twin(url) as store:  # each read below is made through both paths and compared
        for job_id in ids:
            store.job_status(job_id, now)
            store.job_events(job_id)
            store.job_events(job_id, 1)
        assert len(store.job_events(ids[0])) == 2
        assert [s.job_id for s in store.list_jobs(2, now)] == [ids[2], ids[1]]
    assert read_job_status(url, "job_missing", now) is None  # the full store words the error


def test_sqlite_read_path_declines_what_it_cannot_answer(tmp_path):
    assert sqlite_file("postgresql+psycopg://u@h/db") is None
    assert sqlite_file("sqlite:///:memory:") is None
    assert sqlite_file("sqlite:///x.db?timeout=3") is None
    assert read_job_status(f"sqlite:///{tmp_path / 'absent.db'}", "job_x") is None
    (tmp_path / "junk.db").write_bytes(b"not a database")
    assert read_job_status(f"sqlite:///{tmp_path / 'junk.db'}", "job_x") is None


def test_a_store_from_before_the_item_counters_is_left_to_the_full_store(tmp_path):
    url, ids = make_store(tmp_path)
    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        conn.execute("DROP TABLE item_counts")  # as a layerbus before the counters left it
    assert read_job_status(url, ids[0]) is None and read_recent_jobs(url, 5) is None
    with JobStore.open(url):  # counts the items once and keeps the counters from then on
        pass
    assert read_job_status(url, ids[0]).counts == {"queued": 4, "in_progress": 2, "completed": 2, "failed": 2,
                                                   "cancelled": 0, "waiting": 0}


@pytest.mark.cluster
def test_status_command_on_sqlite_imports_no_sqlalchemy(tmp_path):
    url, ids = make_store(tmp_path)
    code = ("import sys, runpy; sys.argv = ['layerbus', 'status', %r, '--db', %r];"
            "from cli.main import main\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('SQLALCHEMY' if 'sqlalchemy' in sys.modules else 'LIGHT')") % (ids[0], url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert ids[0] in out and "10 total: 2 completed, 2 failed, 0 cancelled, 4 queued, 2 in progress" in out
    assert out.strip().endswith("LIGHT"), out
