"""Helpers for the CLI tests: the `layerbus` console script run as users do, a subprocess with its own
LAYERBUS_HOME; a `layerbus run` started in the background, waited on through its store, and its Parquet results
held against the store."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from layerbus.storage import JobStore
from layerbus.storage.results import read_results

REPO = Path(__file__).resolve().parents[2]
JOB_ID = re.compile(r"job_[0-9a-f]{12}")
RUN_TIMEOUT_S = 120


def layerbus_executable() -> str:
    beside_python = Path(sys.executable).parent / "layerbus"
    found = str(beside_python) if beside_python.exists() else shutil.which("layerbus")
    if found is None:
        raise RuntimeError("no layerbus console script: `pip install -e .` in this environment")
    return found


def cli_env(home: Path) -> dict[str, str]:
    """The environment for a CLI process: its own LAYERBUS_HOME, so nothing touches ~/.local."""
    return {**os.environ, "LAYERBUS_HOME": str(home), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}


def layerbus(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([layerbus_executable(), *map(str, args)], env=cli_env(home), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def status_json(home: Path, *args: str) -> dict | list:
    result = layerbus(home, "status", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def write_jsonl(path: Path, items: list[dict | str]) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return path


def documents(count: int) -> list[dict]:
    return [{"id": f"doc-{i:02d}", "text": f"The stage receives batch {i} and sends the result on."}
            for i in range(count)]


def start_run(home: Path, log: Path, *args) -> subprocess.Popen:
    with open(log, "w") as handle:
        return subprocess.Popen([layerbus_executable(), "run", *map(str, args)], env=cli_env(home), cwd=REPO,
                                stdout=handle, stderr=subprocess.STDOUT)


def wait_for_job(db: str, ready, what: str, process: subprocess.Popen, log: Path) -> str:
    """Poll the store until the latest job's status satisfies `ready`; returns the job id."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with JobStore.open(db) as store:
        while time.monotonic() < deadline:
            assert process.poll() is None, f"run ended early ({process.returncode}):\n{log.read_text()}"
            job_id = store.latest_job_id()
            if job_id is not None and ready(store.job_status(job_id)):
                return job_id
            time.sleep(0.05)
    raise AssertionError(f"no {what} within {RUN_TIMEOUT_S} s:\n{log.read_text()}")


def assert_parquet_matches_store(db: str, job_id: str, path: str) -> list[dict]:
    rows = read_results(Path(path)).to_pylist()
    with JobStore.open(db) as store:
        stored = {row["custom_id"]: row for row in store.item_results(job_id)}
    assert len(rows) == len({r["custom_id"] for r in rows}) == len(stored), "every custom_id exactly once"
    for row in rows:
        assert row["status"] == stored[row["custom_id"]]["status"]
        assert row["output"] == stored[row["custom_id"]]["output"]
    return rows


def run_outputs(folder: Path, corpus: Path, model: Path, *args: str, timeout: float) -> dict[str, str]:
    """custom_id -> output of one `layerbus run` of corpus, with its own home and SQLite store in folder: the
    reference that a run through several brokers or chains must give."""
    home, db = folder / "home", f"sqlite:///{folder / 'jobs.db'}"
    done = layerbus(home, "run", corpus, "--model", model, "--db", db, *args, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return result_outputs(status_json(home, JOB_ID.search(done.stdout).group(), "--db", db)["results_path"])


def result_outputs(path: str) -> dict[str, str]:
    """custom_id -> output of a job's results file."""
    return {row["custom_id"]: row["output"] for row in pq.read_table(path).to_pylist()}
