"""The server's keeper: a thread that looks at every open batch each second. It expires a batch whose completion
window ran out (its queued items are cancelled; what completed is kept and returned, as OpenAI does), writes a
finished batch's output and error files from the store, and fails a batch left validating by a server that stopped.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path, PurePath

from layerbus.serve.server import Server, new_id
from layerbus.storage.api_records import BATCH_SUBMITTED, BATCH_VALIDATING, ApiBatch, ApiFile
from layerbus.storage.errors import StoreError
from layerbus.storage.states import CANCELLABLE_JOB_STATES, FINAL_JOB_STATES
from layerbus.storage.status_records import JobStatus

LOG = logging.getLogger(__name__)
EXPIRED_ERROR = ("batch_expired", "this request was not run before the batch's completion window ended")


class BatchKeeper:
    """Runs `look()` every `interval_s` on a daemon thread until stopped."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batch-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self._server.config.keeper_interval_s):
            try:
                look(self._server)
            except Exception:  # the next look tries again; a store that stays away is in the log each second
                LOG.exception("the batch keeper's look failed")


def look(server: Server) -> None:
    """One pass over the open batches, and a token sample of each running job."""
    for job in server.store.list_jobs(limit=50):
        if job.status in ("in_progress", "finalizing", "cancelling"):
            server.token_samples.record(job.job_id, server.clock(), job.completion_tokens)
    for batch in server.api.open_batches():
        if batch.status == BATCH_VALIDATING:
            if batch.id not in server.validating and batch.created_at < server.started_at:
                server.api.update_batch(batch.id, only_if_status=(BATCH_VALIDATING,), status="failed",
                                        errors_json=_one_error("the server stopped while validating this batch; "
                                                               "create it again"), finished_at=server.now())
            continue
        if batch.status != BATCH_SUBMITTED or batch.job_id is None:
            continue
        job = server.store.job_status(batch.job_id)
        if job.status in FINAL_JOB_STATES:
            finish(server, batch, job)
        elif batch.expired_at is None and server.now() >= batch.expires_at and job.status in CANCELLABLE_JOB_STATES:
            expire(server, batch)


def expire(server: Server, batch: ApiBatch) -> None:
    server.api.update_batch(batch.id, expired_at=server.now())
    cancel_job_quietly(server, batch.job_id)


def cancel_job_quietly(server: Server, job_id: str | None) -> None:
    """Cancel the job's queued items; a job already past cancelling (finalizing, over) is left to finish."""
    if job_id is None:
        return
    try:
        server.store.cancel_job(job_id)
    except StoreError as error:
        LOG.info("job %s not cancelled: %s", job_id, error)


def finish(server: Server, batch: ApiBatch, job: JobStatus) -> None:
    """Write the batch's output and error files, then give it its final status."""
    from layerbus.jobs.openai_output import OutputJob, join_by_seq, write_openai_files

    ended = job.timestamps.get(f"{job.status}_at") or server.now()
    output_job = OutputJob(job_id=job.job_id, model=PurePath(job.model).name or job.model, created=int(ended.timestamp()))
    folder = server.config.files_dir
    out_id, err_id = new_id("file-"), new_id("file-")
    out_path, err_path = folder / f"{out_id}.jsonl", folder / f"{err_id}.jsonl"
    cancelled = EXPIRED_ERROR if batch.expired_at is not None else None
    with out_path.open("w", encoding="utf-8") as output, err_path.open("w", encoding="utf-8") as errors:
        items = join_by_seq(server.store.item_results(job.job_id), server.store.job_items(job.job_id))
        counts = write_openai_files(output_job, items, output, errors, cancelled_error=cancelled)
    ids = {"output_file_id": _keep(server, batch, out_id, out_path, "batch_output.jsonl", counts.output),
           "error_file_id": _keep(server, batch, err_id, err_path, "batch_errors.jsonl", counts.errors)}
    status = {"completed": "completed", "failed": "failed", "cancelled": "cancelled"}[job.status]
    if status == "cancelled" and batch.expired_at is not None:
        status = "expired"
    errors_json = _one_error(job.error, code="batch_failed") if status == "failed" and job.error else None
    server.api.update_batch(batch.id, only_if_status=(BATCH_SUBMITTED,), status=status, finished_at=server.now(),
                            errors_json=errors_json, **ids)


def _keep(server: Server, batch: ApiBatch, file_id: str, path: Path, name: str, lines: int) -> str | None:
    """Record a written file as the batch owner's; an empty one is removed (OpenAI gives no id for it)."""
    if lines == 0:
        path.unlink(missing_ok=True)
        return None
    server.api.add_file(ApiFile(id=file_id, owner=batch.owner, filename=f"{batch.id}_{name}", purpose="batch_output",
                                bytes=path.stat().st_size, lines=lines, path=str(path), created_at=server.now()))
    return file_id


def _one_error(message: str, code: str = "batch_failed") -> str:
    import json

    return json.dumps([{"code": code, "line": None, "message": message, "param": None}])
