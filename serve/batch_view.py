"""A batch as OpenAI's Batch object: its status and times from its own record and, once it runs, from its job.

Pure: the record and the job's status in, the object out (tests/unit/test_serve_batch_view.py is its table). Job
states are the Batch API's already; `queued` (validated, no item claimed yet) reads as in_progress, as OpenAI's
batches go straight from validating to in_progress, and a finished job reads as finalizing until the server has
written its output and error files.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from layerbus.storage.api_records import BATCH_SUBMITTED, BATCH_VALIDATING, ApiBatch
from layerbus.storage.status_records import JobStatus

# The job's state -> the batch's, while the batch's files are not written yet.
_RUNNING = {"validating": "validating", "queued": "in_progress", "in_progress": "in_progress",
            "finalizing": "finalizing", "cancelling": "cancelling", "completed": "finalizing",
            "failed": "finalizing", "cancelled": "finalizing"}


def batch_status(batch: ApiBatch, job: JobStatus | None) -> str:
    if batch.status == BATCH_VALIDATING and batch.cancelling_at is not None:
        return "cancelling"
    if batch.status != BATCH_SUBMITTED or job is None:
        return batch.status if batch.status != BATCH_SUBMITTED else "in_progress"
    status = _RUNNING[job.status]
    if status in ("in_progress", "finalizing") and batch.cancelling_at is not None and job.status != "completed":
        return "cancelling"  # until the files of what ran are written
    return status


def batch_object(batch: ApiBatch, job: JobStatus | None) -> dict[str, Any]:
    status = batch_status(batch, job)
    times = job.timestamps if job is not None else {}
    final = batch.finished_at if batch.status not in (BATCH_VALIDATING, BATCH_SUBMITTED) else None
    job_end = next((times.get(f"{state}_at") for state in ("completed", "failed", "cancelled")
                    if times.get(f"{state}_at") is not None), None)
    errors = json.loads(batch.errors_json) if batch.errors_json else None
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window, "status": status,
        "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _unix(batch.created_at),
        "in_progress_at": _unix(times.get("queued_at")),
        "expires_at": _unix(batch.expires_at),
        "finalizing_at": _unix(times.get("finalizing_at") or job_end),
        "completed_at": _unix(final) if batch.status == "completed" else None,
        "failed_at": _unix(final) if batch.status == "failed" else None,
        "expired_at": _unix(batch.expired_at),
        "cancelling_at": _unix(batch.cancelling_at or times.get("cancelling_at")),
        "cancelled_at": _unix(final) if batch.status == "cancelled" else None,
        "request_counts": request_counts(batch, job),
        "metadata": json.loads(batch.metadata_json) or None,
        "model": job.model.rstrip("/").rsplit("/", 1)[-1] if job is not None else None,
    }  # fmt: skip


def request_counts(batch: ApiBatch, job: JobStatus | None) -> dict[str, int]:
    """total, completed and failed requests; once the batch is final, cancelled and expired ones count as failed
    (they are in the error file), so completed + failed is the total."""
    if job is None:
        return {"total": 0, "completed": 0, "failed": 0}
    failed = job.failed + (job.cancelled if batch.status not in (BATCH_VALIDATING, BATCH_SUBMITTED) else 0)
    return {"total": job.total, "completed": job.completed, "failed": failed}


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())
