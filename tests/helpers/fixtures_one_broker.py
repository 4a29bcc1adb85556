"""A small job and one broker's outputs on it: what the runs through a front door's chains, or through a chain that
a stage joins mid-job, must give, token for token.

Imported by name into the modules that use them (`from tests.helpers.fixtures_one_broker import corpus,
one_brokers_outputs`), with the tiny llama (`model`, tests/helpers/fixtures_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import JOB_ID, assert_parquet_matches_store, layerbus, status_json, write_jsonl

ITEMS = 60
JOB_ARGS = ("--task", "summarize", "--max-new-tokens", "6")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl",
                       [{"id": f"doc-{i:02d}", "text": f"Front door {i} sends stage {i % 2} on."} for i in range(ITEMS)])


@pytest.fixture(scope="module")
def one_brokers_outputs(tmp_path_factory, corpus, model) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("single")
    home, db = folder / "home", f"sqlite:///{folder / 'jobs.db'}"
    done = layerbus(home, "run", corpus, "--model", model, "--db", db, "--stages", "1", "--threads-per-stage", "1",
                    *JOB_ARGS, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    job_id = JOB_ID.search(done.stdout).group()
    rows = assert_parquet_matches_store(db, job_id, status_json(home, job_id, "--db", db)["results_path"])
    return {row["custom_id"]: row["output"] for row in rows}
