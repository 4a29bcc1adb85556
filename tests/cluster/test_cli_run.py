"""`layerbus run` end to end: a tiny model on 2 real stage processes, a real SQLite store, Parquet results;
then a cancel from another process, and Ctrl-C followed by `run --job` resuming the job."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from layerbus.storage.results import results_metadata
from tests.helpers.cli import (JOB_ID, RUN_TIMEOUT_S, assert_parquet_matches_store, documents, layerbus, start_run,
                                status_json, wait_for_job, write_jsonl)
from tests.helpers.fixtures_cli import home, tiny  # noqa: F401 - fixtures


def test_run_end_to_end(home, tmp_path, tiny):
    items = documents(10) + [
        {"id": "too-long", "text": "word " * 150},  # over --max-context, with --long-documents fail: fails alone
        {"custom_id": "openai-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Count from one to ten."}], "max_tokens": 3}},
    ]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", items)
    db = f"sqlite:///{tmp_path / 'jobs.db'}"

    result = layerbus(home, "run", corpus, "--task", "summarize", "--model", tiny, "--stages", "2", "--db", db,
                      "--max-new-tokens", "12", "--max-context", "128", "--slots", "4", "--long-documents", "fail",
                      timeout=RUN_TIMEOUT_S)

    assert result.returncode == 0, result.stderr
    job_id = JOB_ID.search(result.stdout).group()
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed"
    path = status["results_path"]
    assert path and path in result.stdout and Path(path).is_relative_to(home / "results")
    rows = assert_parquet_matches_store(db, job_id, path)
    assert sorted(r["custom_id"] for r in rows) == sorted(item.get("id") or item["custom_id"] for item in items)
    by_id = {r["custom_id"]: r for r in rows}
    assert by_id["too-long"]["status"] == "failed" and "context" in by_id["too-long"]["error"]
    assert 1 <= by_id["openai-1"]["completion_tokens"] <= 3, "the item's max_tokens overrides the job's"
    assert all(r["status"] == "completed" and 1 <= r["completion_tokens"] <= 12 for r in rows
               if r["custom_id"].startswith("doc-"))
    counts = status["request_counts"]
    assert (counts["total"], counts["completed"], counts["failed"]) == (12, 11, 1)
    assert counts["completed"] == sum(r["status"] == "completed" for r in rows)
    assert status["tokens"]["completion"] == sum(r["completion_tokens"] for r in rows)
    assert status["tokens"]["prompt"] == sum(r["prompt_tokens"] for r in rows)
    metadata = results_metadata(Path(path))
    assert (metadata["job_id"], metadata["model"]) == (job_id, str(tiny))
    assert '"task": "summarize"' in metadata["settings"]
    assert sorted(p.name for p in (home / "logs" / job_id).iterdir()) == ["stage-0.log", "stage-1.log"]

    shown = layerbus(home, "results", job_id, "--head", "3", "--db", db)
    assert shown.returncode == 0 and shown.stdout.splitlines()[0] == path and "doc-00" in shown.stdout
    watched = layerbus(home, "status", job_id, "--watch", "--db", db)
    assert watched.returncode == 0 and "completed" in watched.stdout
    rerun = layerbus(home, "run", "--job", job_id, "--stages", "2", "--db", db)
    assert rerun.returncode == 0 and path in rerun.stdout, "a completed job is reported, not run again"


def test_cancel_mid_job_keeps_finished_outputs(home, tmp_path, tiny):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(200))  # far more than runs before the cancel
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    log = tmp_path / "run.log"
    run = start_run(home, log, corpus, "--task", "summarize", "--model", tiny, "--stages", "2", "--db", db,
                    "--max-new-tokens", "64", "--slots", "2", "--threads-per-stage", "1")
    try:
        # Results reach the store in batches (every 64 items or 2 s), so this is the first batch.
        job_id = wait_for_job(db, lambda status: status.completed >= 2, "completed items", run, log)
        cancel = layerbus(home, "cancel", job_id, "--db", db)
        assert cancel.returncode == 0 and cancel.stdout.strip() in ("cancelling", "cancelled"), cancel.stderr
        assert run.wait(RUN_TIMEOUT_S) == 1, log.read_text()
    finally:
        run.kill()

    status = status_json(home, job_id, "--db", db)
    counts = status["request_counts"]
    assert status["status"] == "cancelled", log.read_text()
    assert counts["completed"] >= 2 and counts["cancelled"] > 0
    assert counts["completed"] + counts["failed"] + counts["cancelled"] == counts["total"] == 200
    assert counts["queued"] == counts["in_progress"] == 0
    rows = assert_parquet_matches_store(db, job_id, status["results_path"])
    assert len(rows) == 200
    assert sum(r["status"] == "completed" for r in rows) == counts["completed"]
    assert all(r["output"] is not None for r in rows if r["status"] == "completed"), "finished outputs are kept"


def test_ctrl_c_requeues_and_run_job_resumes(home, tmp_path, tiny):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(30))
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    log = tmp_path / "run.log"
    run = start_run(home, log, corpus, "--task", "summarize", "--model", tiny, "--stages", "2", "--db", db,
                    "--max-new-tokens", "48", "--slots", "2", "--threads-per-stage", "1")
    try:
        # Interrupt soon after the first claim: long before the job could finish, however fast the machine.
        job_id = wait_for_job(db, lambda status: status.in_progress > 0, "claimed items", run, log)
        time.sleep(0.5)
        run.send_signal(signal.SIGINT)
        assert run.wait(RUN_TIMEOUT_S) == 130, log.read_text()
    finally:
        run.kill()
    interrupted = status_json(home, job_id, "--db", db)
    assert interrupted["status"] == "in_progress", log.read_text()
    assert interrupted["request_counts"]["in_progress"] == 0, "items in flight were requeued"
    assert interrupted["request_counts"]["queued"] > 0
    assert f"run --job {job_id}" in log.read_text()

    resumed = layerbus(home, "run", "--job", job_id, "--stages", "2", "--db", db, "--slots", "8",
                       timeout=RUN_TIMEOUT_S)

    assert resumed.returncode == 0, resumed.stderr
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == 30
    rows = assert_parquet_matches_store(db, job_id, status["results_path"])
    assert sorted(r["custom_id"] for r in rows) == [f"doc-{i:02d}" for i in range(30)]
