"""Long documents through `layerbus run` on 2 real stage processes: split, mapped and reduced into one row per
document; the broker and its stages killed with SIGKILL once the reduce is queued, and `run --job` gives
the results an uninterrupted run gives."""

from __future__ import annotations

import os
import signal

from layerbus.storage import JobStore
from tests.helpers.cli import (RUN_TIMEOUT_S, assert_parquet_matches_store, layerbus, result_outputs, run_outputs,
                                start_run, status_json, wait_for_job, write_jsonl)
from tests.helpers.fixtures_cli import home, tiny  # noqa: F401 - fixtures
from tests.helpers.processes import descendants


def corpus_of(tmp_path):
    long = "\n\n".join(f"Paragraph {n} tells of stage {n}. It sends the batch on. Then it waits." for n in range(1, 9))
    items = [{"id": f"short-{i}", "text": f"The stage receives batch {i} and sends it on."} for i in range(3)]
    return write_jsonl(tmp_path / "corpus.jsonl", [*items, {"id": "long", "text": long}])


ARGS = ("--task", "summarize", "--stages", "2", "--max-new-tokens", "8", "--max-context", "256",
        "--max-chunk-tokens", "60", "--slots", "4")


def test_a_long_document_killed_mid_reduce_resumes_to_the_uninterrupted_results(home, tmp_path, tiny):
    corpus = corpus_of(tmp_path)
    (tmp_path / "reference").mkdir()
    expected = run_outputs(tmp_path / "reference", corpus, tiny, *ARGS, timeout=RUN_TIMEOUT_S)
    assert sorted(expected) == ["long", "short-0", "short-1", "short-2"], "one row per document"

    db, log = f"sqlite:///{tmp_path / 'jobs.db'}", tmp_path / "run.log"
    run = start_run(home, log, corpus, "--model", tiny, "--db", db, *ARGS)
    try:
        job_id = wait_for_job(db, lambda status: status.counts["waiting"] == 0 and status.total > 4,
                              "the reduce queued", run, log)
        for pid in [run.pid, *descendants(run.pid)]:  # the broker and its stages, as a lost machine loses them
            os.kill(pid, signal.SIGKILL)
        run.wait(RUN_TIMEOUT_S)
    finally:
        run.kill()
    with JobStore.open(db) as store:
        assert store.job_status(job_id).status == "in_progress", "killed before the job was done"

    resumed = layerbus(home, "run", "--job", job_id, "--stages", "2", "--db", db, timeout=RUN_TIMEOUT_S)

    assert resumed.returncode == 0, resumed.stderr
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["documents"]["split"] == 1
    assert status["documents"]["reduce_levels_remaining"] == 0
    assert_parquet_matches_store(db, job_id, status["results_path"])
    assert result_outputs(status["results_path"]) == expected
