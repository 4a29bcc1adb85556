"""What `layerbus status` shows of a job: its status, its events and the brokers working it.

Apart from storage.records (whose other records a submit or a broker needs) because a dataclass costs
about a millisecond to create at import, and the light commands need only these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

# The job_workers columns a JobWorker is built from, in its field order (both store paths read these).
WORKER_FIELDS = ("worker", "host", "chain", "state", "items_done", "completion_tokens", "lease_s", "started_at",
                 "renewed_at")


@dataclass(frozen=True)
class JobStatus:
    """A job's state and progress, as `layerbus status` shows it."""

    # jobs.id, e.g. "job_0123456789ab".
    job_id: str
    # Human name given at submit; may be empty.
    name: str
    # Task of the job.
    task: str
    # Model of the job.
    model: str
    # One of storage.states.JOB_STATES.
    status: str
    # When the job entered each state: keys are the jobs timestamp columns (created_at, queued_at, ...),
    # values UTC datetimes, or None for states not reached.
    timestamps: dict[str, datetime | None]
    # Number of items, invalid ones included.
    total: int
    # Items per item state; every state of storage.states.ITEM_STATES is a key.
    counts: dict[str, int]
    # Items finished with an output.
    completed: int
    # Items that failed (at submit or while running).
    failed: int
    # Items cancelled before running.
    cancelled: int
    # Items waiting to be claimed.
    queued: int
    # Items claimed by a worker and not yet reported.
    in_progress: int
    # Prompt tokens over all finished items.
    prompt_tokens: int
    # Generated tokens over all finished items.
    completion_tokens: int
    # completion_tokens per second since the job went in_progress (until it left in_progress, if it has);
    # None before any item ran.
    tokens_per_s: float | None
    # Seconds to finish the queued and in-progress items at the rate items have finished so far;
    # None unless the job is in_progress and at least one item has finished running.
    eta_s: float | None
    # Final Parquet file, once written.
    results_path: str | None
    # Why the job failed, when it did.
    error: str | None


@dataclass(frozen=True)
class JobEvent:
    """One thing that happened to a job while it ran (a stage lost, a re-plan, a recovery), as status shows it."""

    # When it happened, UTC; for a span of time (a recovery), when it ended.
    at: datetime
    # What kind of event: stage_lost, waiting, recovered, first_token, load_failed, replanned, resumed, ...
    kind: str
    # What happened, in words.
    message: str
    # How long it took, in seconds, when the event is a span of time; None otherwise.
    duration_s: float | None


@dataclass(frozen=True)
class JobWorker:
    """One broker that worked a job, as `layerbus status JOB` shows it (storage/job_workers.py)."""

    # Its name in the store's claims, "host:pid:token" (items.claimed_by).
    worker: str
    # The machine it runs on.
    host: str
    # Its chain of stages in text form, or None when it did not say.
    chain: str | None
    # working, finalizing or stopped, as it last recorded; see `state_at` for what a reader should show.
    state: str
    # Items it recorded as done (completed or failed).
    items_done: int
    # Tokens those items generated.
    completion_tokens: int
    # Its lease in seconds: a working broker silent for longer than this is gone.
    lease_s: float
    # When it started working the job, UTC.
    started_at: datetime
    # Its last lease renewal (or start, or stop), UTC.
    renewed_at: datetime

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second between its start and its last renewal; None before a second passed."""
        seconds = (self.renewed_at - self.started_at).total_seconds()
        return self.completion_tokens / seconds if seconds >= 1 else None

    def state_at(self, now: datetime) -> str:
        """Its state as a reader should see it: a working or finalizing broker that has not renewed within
        its lease is `lost` (killed, stopped or cut off; its items go back to the queue)."""
        if self.state != "stopped" and (now - self.renewed_at).total_seconds() > self.lease_s:
            return "lost"
        return self.state


def worker_from_row(row: Mapping[str, Any]) -> JobWorker:
    """A JobWorker from a job_workers row keyed by WORKER_FIELDS, its times already aware UTC datetimes."""
    return JobWorker(worker=str(row["worker"]), host=str(row["host"]), chain=row["chain"], state=str(row["state"]),
                     items_done=int(row["items_done"]), completion_tokens=int(row["completion_tokens"]),
                     lease_s=float(row["lease_s"]), started_at=row["started_at"], renewed_at=row["renewed_at"])


@dataclass(frozen=True)
class DocumentProgress:
    """A job's long documents: how many were split, the parts they became and how far they are."""

    # Documents split into parts (the others are one item each).
    split: int
    # Their parts: pieces of text, and the reduces below each document's own item.
    parts: int
    # Of those, parts finished (completed, failed or cancelled).
    parts_done: int
    # Split documents whose own item is finished.
    documents_done: int
    # Reduce levels with work not finished yet, the documents' own items included (0 for a translation,
    # whose pieces are joined without a model call).
    levels_remaining: int
