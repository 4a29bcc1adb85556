"""`kill -9` of the broker (`layerbus run`) mid-job, then `layerbus run --job`: the job completes with
the outputs of an unfaulted run, every custom_id once, and no Parquet file is ever unreadable."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq

from layerbus.storage import JobStore
from tests.helpers.cli import (JOB_ID, RUN_TIMEOUT_S, assert_parquet_matches_store, layerbus, start_run, status_json,
                               wait_for_job, write_jsonl)

RUN_ARGS = ("--task", "summarize", "--stages", "2", "--max-new-tokens", "48", "--slots", "2",
            "--threads-per-stage", "1")


def documents(count: int) -> list[dict]:
    return [{"id": f"doc-{i:02d}", "text": f"Batch {i} moves through the stages, {i % 7} layers at a time."}
            for i in range(count)]


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every process under `pid`: the stages, and the launcher they were forked from (launch.stage_launcher)."""
    found = children(pid)
    return found + [grandchild for child in found for grandchild in descendants(child)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


class ParquetWatcher(threading.Thread):
    """Reads every Parquet file under a folder, over and over, while the job runs: any file under a
    final name must always be whole."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.stopped, self.errors, self.reads = folder, threading.Event(), [], 0

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                paths = list(self.folder.rglob("*.parquet"))
            except FileNotFoundError:  # a parts folder removed while listing it (finalize)
                continue
            for path in paths:
                try:
                    pq.read_table(path)
                    self.reads += 1
                except FileNotFoundError:
                    pass  # merged into the final file and deleted meanwhile
                except Exception as error:  # noqa: BLE001 - any unreadable file is the failure we look for
                    self.errors.append(f"{path.name}: {error}")
            time.sleep(0.01)


def outputs(path: str) -> dict[str, str]:
    return {row["custom_id"]: row["output"] for row in pq.read_table(path).to_pylist()}


def test_kill_9_of_the_broker_then_resume_gives_the_unfaulted_outputs(tmp_path, tiny_models):
    model = tiny_models("llama")
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(120))

    clean_home, clean_db = tmp_path / "clean", f"sqlite:///{tmp_path / 'clean.db'}"
    clean = layerbus(clean_home, "run", corpus, "--model", model, "--db", clean_db, *RUN_ARGS, timeout=RUN_TIMEOUT_S)
    assert clean.returncode == 0, clean.stderr
    expected = outputs(status_json(clean_home, JOB_ID.search(clean.stdout).group(), "--db", clean_db)["results_path"])

    home, db, log = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}", tmp_path / "run.log"
    (home / "results").mkdir(parents=True)
    watcher = ParquetWatcher(home / "results")
    watcher.start()
    run = start_run(home, log, corpus, "--model", model, "--db", db, *RUN_ARGS)
    try:
        job_id = wait_for_job(db, lambda status: status.completed >= 1, "committed items", run, log)
        processes = descendants(run.pid)
        stages = [pid for pid in processes if not children(pid)]  # the launcher has the stages under it
        assert len(stages) == 2, f"expected 2 stage processes under the broker, found {stages} of {processes}"
        os.kill(run.pid, signal.SIGKILL)
        run.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in processes), "the killed broker's stages must not outlive it"
    finally:
        run.kill()
    with JobStore.open(db) as store:
        killed = store.job_status(job_id)
    assert killed.status == "in_progress" and killed.completed < 120, "killed mid-job"

    resumed = layerbus(home, "run", "--job", job_id, "--db", db, *RUN_ARGS[2:], timeout=RUN_TIMEOUT_S)
    watcher.stopped.set()
    watcher.join()

    assert resumed.returncode == 0, resumed.stderr
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == 120
    assert_parquet_matches_store(db, job_id, status["results_path"])
    assert outputs(status["results_path"]) == expected
    assert watcher.reads > 0 and watcher.errors == []
    with JobStore.open(db) as store:
        # The killed run and the resumed one each record where the layers went and the links their stages
        # timed; the second one said that the first broker's process is gone, resumed, and at its end recorded
        # what its prefix cache did, its drafting figures (speculation is on by default) and its plan's prediction
        # against what it measured (the killed run never reached its end).
        assert [event.kind for event in store.job_events(job_id)] == ["placed", "links", "worker_lost", "resumed",
                                                                     "placed", "links", "prefix_cache", "speculation",
                                                                     "predicted"]
