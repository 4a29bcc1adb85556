"""The jobs table of `layerbus status`: completed, failed and cancelled apart, so a cancelled or
all-failed job never reads as done (pure formatting, table-tested)."""

from __future__ import annotations

import pytest

from layerbus.cli.status import jobs_table
from layerbus.storage.records import JobStatus


def job(status: str, completed: int = 0, failed: int = 0, cancelled: int = 0, queued: int = 0) -> JobStatus:
    total = completed + failed + cancelled + queued
    counts = {"queued": queued, "in_progress": 0, "completed": completed, "failed": failed, "cancelled": cancelled}
    return JobStatus(job_id="job_000000000001", name="", task="summarize", model="m", status=status, timestamps={},
                     total=total, counts=counts, completed=completed, failed=failed, cancelled=cancelled,
                     queued=queued, in_progress=0, prompt_tokens=0, completion_tokens=0, tokens_per_s=None,
                     eta_s=None, results_path=None, error=None)


@pytest.mark.parametrize("status, want", [
    # A million items cancelled: nothing completed, and the table says so.
    (job("cancelled", cancelled=1_000_000), ["cancelled", "0/1000000", "0", "1000000"]),
    # Every item failed: OpenAI's Batch API calls it completed; the table adds that nothing succeeded.
    (job("completed", failed=2), ["completed (none succeeded)", "0/2", "2", "0"]),
    (job("completed", completed=3, failed=1), ["completed", "3/4", "1", "0"]),
    (job("in_progress", completed=1, queued=4), ["in_progress", "1/5", "0", "0"]),
])
def test_jobs_table_keeps_outcomes_apart(status, want) -> None:
    header, row = jobs_table([status]).splitlines()
    assert header.split()[1:6] == ["STATUS", "TASK", "COMPLETED/TOTAL", "FAILED", "CANCELLED"]
    cells = [cell for cell in row.split("  ") if cell.strip()]
    assert [cells[1].strip(), cells[3].strip(), cells[4].strip(), cells[5].strip()] == want


def test_the_workers_table_shows_each_broker_and_calls_a_silent_one_lost() -> None:
    from datetime import datetime, timedelta, timezone

    from layerbus.cli.status import job_report, status_json, workers_table
    from layerbus.storage.records import JobWorker

    t0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    workers = [JobWorker("box-a:11:aa", "box-a", "stage-0 [0, 30)", "working", 1200, 24000, 60.0, t0,
                         t0 + timedelta(seconds=100)),
               JobWorker("box-b:22:bb", "box-b", None, "working", 800, 16000, 5.0, t0, t0 + timedelta(seconds=50))]
    now = t0 + timedelta(seconds=102)
    header, first, second = workers_table(workers, now).splitlines()
    assert header.split() == ["WORKER", "HOST", "STATE", "ITEMS", "TOK/S", "LAST", "RENEWAL", "(UTC)", "CHAIN"]
    assert first.split() == ["box-a:11:aa", "box-a", "working", "1200", "240.0", "2030-01-02", "03:05:45", "(2s",
                             "ago)", "stage-0", "[0,", "30)"]
    assert second.split()[:5] == ["box-b:22:bb", "box-b", "lost", "800", "320.0"], "silent past its 5 s lease"
    assert "\nworkers\n" in job_report(job("in_progress", completed=2000), (), workers, now)
    (as_json, _) = status_json(job("in_progress"), [], workers, now)["workers"]
    assert (as_json["worker"], as_json["state"], as_json["items_done"], as_json["last_renewal_age_s"]) == (
        "box-a:11:aa", "working", 1200, 2.0)
