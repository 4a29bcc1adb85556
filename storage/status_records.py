"""What `layerbus status` shows of a job: its status and its events.

Apart from storage.records (whose other records a submit or a broker needs) because a dataclass costs
about a millisecond to create at import, and the light commands need only these two.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


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
