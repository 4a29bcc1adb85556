"""A batch's OpenAI status, times and counts from its record and its job's state (serve/batch_view.py), as a table."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from layerbus.serve.batch_view import batch_object, batch_status
from layerbus.storage.api_records import ApiBatch
from layerbus.storage.states import ITEM_STATES
from layerbus.storage.status_records import JobStatus

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
BATCH = ApiBatch(id="batch_1", owner="alice", input_file_id="file-1", endpoint="/v1/chat/completions",
                 completion_window="24h", expires_at=T0 + timedelta(hours=24), metadata_json="{}", status="submitted",
                 job_id="job_1", errors_json=None, output_file_id=None, error_file_id=None, created_at=T0,
                 cancelling_at=None, expired_at=None, finished_at=None)


def job(status: str, completed: int = 0, failed: int = 0, cancelled: int = 0, **times: datetime) -> JobStatus:
    counts = dict.fromkeys(ITEM_STATES, 0) | {"completed": completed, "failed": failed, "cancelled": cancelled}
    return JobStatus(job_id="job_1", name="batch_1", task="generate", model="/models/tiny", status=status,
                     timestamps={"created_at": T0, **times}, total=4, counts=counts, completed=completed,
                     failed=failed, cancelled=cancelled, queued=0, in_progress=0, prompt_tokens=0, completion_tokens=0,
                     tokens_per_s=None, eta_s=None, results_path=None, error=None)


@pytest.mark.parametrize("record, job_state, expected", [
    ({"status": "validating", "job_id": None}, None, "validating"),
    ({"status": "validating", "job_id": None, "cancelling_at": T0}, None, "cancelling"),
    ({"status": "failed", "job_id": None}, None, "failed"),
    ({}, "queued", "in_progress"),
    ({}, "in_progress", "in_progress"),
    ({}, "finalizing", "finalizing"),
    ({}, "completed", "finalizing"),  # until the server wrote its files
    ({}, "cancelling", "cancelling"),
    ({"cancelling_at": T0}, "in_progress", "cancelling"),
    ({"cancelling_at": T0}, "cancelled", "cancelling"),
    ({"expired_at": T0}, "cancelled", "finalizing"),
    ({"status": "completed"}, "completed", "completed"),
    ({"status": "expired", "expired_at": T0}, "cancelled", "expired"),
    ({"status": "cancelled", "cancelling_at": T0}, "cancelled", "cancelled"),
])
def test_status(record, job_state, expected):
    assert batch_status(replace(BATCH, **record), job(job_state) if job_state else None) == expected


def test_a_final_batch_counts_its_cancelled_requests_as_failed():
    ended = T0 + timedelta(hours=1)
    record = replace(BATCH, status="expired", expired_at=ended, finished_at=ended, output_file_id="file-o")
    shown = batch_object(record, job("cancelled", completed=1, failed=1, cancelled=2, queued_at=T0,
                                     cancelled_at=ended))

    assert shown["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    assert shown["status"] == "expired" and shown["expired_at"] == int(ended.timestamp())
    assert shown["in_progress_at"] == int(T0.timestamp()) and shown["finalizing_at"] == int(ended.timestamp())
    assert shown["cancelled_at"] is None and shown["completed_at"] is None
    assert shown["model"] == "tiny" and shown["metadata"] is None and shown["errors"] is None


def test_a_running_batch_counts_only_what_failed():
    shown = batch_object(BATCH, job("in_progress", completed=1, failed=1, cancelled=2))

    assert shown["request_counts"] == {"total": 4, "completed": 1, "failed": 1}


def test_a_refused_input_shows_its_errors():
    record = replace(BATCH, status="failed", job_id=None, finished_at=T0,
                     errors_json='[{"code": "invalid_request", "line": 2, "message": "malformed JSON", "param": null}]')

    shown = batch_object(record, None)

    assert shown["errors"]["data"][0]["line"] == 2 and shown["failed_at"] == int(T0.timestamp())
    assert shown["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
