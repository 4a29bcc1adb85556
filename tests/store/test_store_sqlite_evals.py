"""The standard-library read path of `layerbus eval history` agrees with JobStore.eval_history on a SQLite file
(tests/helpers/fixtures_stores.py's TwinPathStore reads through both and compares), and declines what it cannot read."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from layerbus.storage import EvalMetric, EvalRun, JobSettings, JobStore, NewItem, canonical_fingerprint
from layerbus.storage.sqlite_evals import read_eval_history
from tests.helpers.fixtures_stores import TwinPathStore

T0 = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)


def make_store(tmp_path: Path) -> str:
    """Four nightly runs (the third never finished, two created in the same microsecond), one other suite."""
    url = f"sqlite:///{tmp_path / 'evals.db'}"
    with JobStore.open(url) as store:
        plan = [("nightly", T0, True), ("nightly", T0 + timedelta(days=1), True),
                ("nightly", T0 + timedelta(days=2), False), ("weekly", T0 + timedelta(days=2), True),
                ("nightly", T0 + timedelta(days=3), True), ("nightly", T0 + timedelta(days=3), True)]
        for day, (suite, created, finish) in enumerate(plan):
            items = [NewItem("t/0", "x", "", {}, 0)]
            job_id = store.create_job(JobSettings(task="eval", model="m"), items, now=created)
            fingerprint_json, fingerprint_hash = canonical_fingerprint({"day": day})
            store.record_eval_run(EvalRun(job_id, suite, "m", fingerprint_hash, fingerprint_json, "{}", created))
            if finish:
                store.finish_eval_run(job_id, f"/s/{day}.parquet", None, [
                    EvalMetric("b-task", "acc", "none", 0.5 + day / 100, 0.01, 40),
                    EvalMetric("a-task", "bits_per_byte", "none", 1.0 - day / 100, None, 40),
                    EvalMetric("a-task", "acc", "none", math.nan, None, 0),
                ], now=created + timedelta(hours=1))
    return url


@pytest.mark.parametrize("metric, limit", [(None, 50), ("acc", 50), (None, 2), ("bits_per_byte", 1), ("absent", 3)])
def test_read_path_matches_the_store(tmp_path, metric, limit):
    url = make_store(tmp_path)
    with TwinPathStore.open_twin(url) as store:  # reads through both paths and compares
        found = store.eval_history("nightly", metric, limit)
    assert len(found) == min(limit, 4)
    assert all(run.created_at.tzinfo is not None for run, _ in found)


def test_read_path_of_an_unknown_suite_is_empty(tmp_path):
    assert read_eval_history(make_store(tmp_path), "monthly") == []


def test_read_path_declines_what_it_cannot_answer(tmp_path):
    assert read_eval_history("postgresql+psycopg://u@h/db", "nightly") is None
    assert read_eval_history(f"sqlite:///{tmp_path / 'absent.db'}", "nightly") is None
    (tmp_path / "junk.db").write_bytes(b"not a database")
    assert read_eval_history(f"sqlite:///{tmp_path / 'junk.db'}", "nightly") is None
    with pytest.raises(ValueError, match="limit >= 1"):
        read_eval_history(f"sqlite:///{tmp_path / 'absent.db'}", "nightly", limit=0)
