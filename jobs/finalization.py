"""The end of one broker's run of a job: it finalizes the job (builds the final results file from the
store and moves the job to completed or failed) when it is the one broker that claimed the finalization
(storage/finalization.py); otherwise it waits while the finalizing broker works, and takes over if that
broker is gone. However many brokers work a job, its final file is written by one.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

from layerbus.jobs.leases import LeaseConfig, LeaseKeeper, gone_holders, note_lost_workers, pid_alive
from layerbus.storage import JobSettings, JobStatus, JobStore, Lease
from layerbus.storage.results import ResultWriter, settings_metadata
from layerbus.storage.states import FINAL_JOB_STATES, RUNNABLE_JOB_STATES

log = logging.getLogger("layerbus.jobs")


class FinalizationKeeper(LeaseKeeper):
    """Renews `worker`'s hold on the job's finalization from a thread of its own while it writes the final
    file (a million rows take a while), so a live finalizer is never taken over; `held` turns False once
    the hold is found lost."""

    held = True

    def tick(self) -> dict[str, int]:
        self.held = self.store.renew_finalization(self.job_id, self.worker, self.config.lease_s)
        return {}


def finish_job(store: JobStore, job_id: str, writer: ResultWriter, settings: JobSettings, worker: str,
               leases: LeaseConfig, wait: Callable[[float], None] = time.sleep) -> JobStatus:
    """Finalize the job if this worker gets the finalization, or wait (`wait(seconds)`, which keeps the
    stages alive) while another worker holds it, taking over once it is gone; the job's status at the end.

    A job with work left (a cancel or a stop ended this run early) is returned as it is.
    """
    gone: list[str] = []
    waiting_on: str | None = None
    while True:
        status = store.job_status(job_id)
        unfinished = status.queued + status.in_progress + status.counts.get("waiting", 0)
        if status.status in RUNNABLE_JOB_STATES and unfinished:
            return status
        if status.status in FINAL_JOB_STATES and (status.status != "cancelled" or status.results_path):
            if status.results_path:  # the final file, from the store, holds this broker's rows (a failed
                writer.discard_parts()  # job's parts stay: they hold outputs of the items it did not finish)
            return status
        claim = store.claim_finalization(job_id, worker, leases.lease_s, gone=gone)
        if claim.claimed:
            note_lost_workers(store, job_id, worker)  # brokers of the job that died: said before it is done
            finished = _finalize(store, job_id, writer, settings, worker, leases)
            if finished is not None:
                return finished
            continue  # its hold was lost meanwhile: whoever took it over finishes the job
        if claim.status == "in_progress":
            continue  # items came back meanwhile (or are still being recorded): look again
        if claim.status != "finalizing" or claim.holder is None:
            return store.job_status(job_id)  # cancelling, or cancelled with another worker writing its file
        gone = gone_holders([Lease(claim.holder, 0, claim.expires_at)], worker, socket.gethostname(), pid_alive)
        if gone:
            note_lost_workers(store, job_id, worker)  # the finalizer died: said before this worker takes it over
            continue
        if waiting_on != claim.holder:
            waiting_on = claim.holder
            log.info("job %s: %s is finalizing it: waiting until it is done (or its hold, until %s, runs out)",
                     job_id, claim.holder, claim.expires_at)
        wait(leases.renew_every_s)


def _finalize(store: JobStore, job_id: str, writer: ResultWriter, settings: JobSettings, worker: str,
              leases: LeaseConfig) -> JobStatus | None:
    """Write the final file and end the job as the holder of its finalization; None when the hold was lost
    before the end (another worker took it over and finishes the job)."""
    store.set_worker_state(job_id, worker, "finalizing")
    with FinalizationKeeper(store, job_id, worker, leases) as keeper:
        try:
            path = _write_results(store, job_id, writer, settings)
        except Exception:
            if keeper.held and store.renew_finalization(job_id, worker, leases.lease_s):
                raise  # still ours: a real failure
            log.warning("job %s: writing the results failed after another worker took the finalization over; "
                        "it finishes the job", job_id, exc_info=True)
            return None
        status = store.job_status(job_id)
        failure = all_failed_message(status)
        # OpenAI's Batch API calls a batch whose every request failed "completed"; users read that as
        # done (kaapi-backend #723), so such a job ends failed, its results file (the errors) still written.
        target = None if status.status == "cancelled" else "failed" if failure else "completed"
        if not store.finish_finalization(job_id, worker, path, target, error=failure if target else None):
            log.warning("job %s: its finalization was taken over by another worker before this one ended it", job_id)
            return None
    log.info("job %s: results in %s", job_id, path)
    return store.job_status(job_id)


def all_failed_message(status: JobStatus) -> str | None:
    """Why a finished job counts as failed: every one of its items failed; None when any succeeded
    (or was cancelled: a cancel is the user's choice, not a failure)."""
    if status.total == 0 or status.failed != status.total:
        return None
    return (f"every item failed ({status.failed} of {status.total}); each item's reason is in the error column "
            f"of the results file, or `layerbus results {status.job_id} --format openai --errors FILE`")


def _write_results(store: JobStore, job_id: str, writer: ResultWriter, settings: JobSettings) -> Path:
    metadata = settings_metadata(job_id, settings.model, json.loads(settings.to_json()))
    return writer.finalize(metadata, store_rows=store.item_results(job_id))
