"""Turning a job row and its per-state item aggregates into a JobStatus: progress, throughput and ETA.

Pure: the store runs the two queries and passes the clock in, so every figure is table-testable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from layerbus.storage.status_records import JobStatus
from layerbus.storage.states import ITEM_STATES, TIMESTAMP_COLUMNS

# Timestamps that end the in_progress phase; throughput is measured up to the first one set.
_END_OF_RUN_COLUMNS = ("finalizing_at", "completed_at", "failed_at", "cancelling_at", "cancelled_at")


@dataclass(frozen=True)
class StateAggregate:
    """Totals over the items of one job in one item state (one row of the status GROUP BY)."""

    # The item state these totals cover.
    status: str
    # Items in that state.
    count: int
    # Of those, items that were claimed at least once (excludes items refused at submit).
    ran: int
    # Sum of prompt_tokens (NULL counts as 0).
    prompt_tokens: int
    # Sum of completion_tokens (NULL counts as 0).
    completion_tokens: int


def reported_aggregates(aggregates: Sequence[StateAggregate], cancelled: bool) -> list[StateAggregate]:
    """The counters as status reports them: once a job was cancelled (its cancelling_at is set, never
    cleared), its queued and waiting items are cancelled ones (storage/item_counts.py: a cancel leaves their
    rows)."""
    if not cancelled:
        return list(aggregates)
    queued = [a for a in aggregates if a.status in ("queued", "waiting")]
    others = [a for a in aggregates if a.status not in ("queued", "waiting", "cancelled")]
    folded = [a for a in aggregates if a.status == "cancelled"] + queued
    if not folded:
        return others
    return others + [StateAggregate("cancelled", *(sum(getattr(a, f) for a in folded)
                                                   for f in ("count", "ran", "prompt_tokens", "completion_tokens")))]


def build_job_status(job: Mapping[str, Any], aggregates: Sequence[StateAggregate], now: datetime) -> JobStatus:
    """The JobStatus of `job` (a jobs row as a mapping) given its item aggregates, as seen at `now`."""
    aggregates = reported_aggregates(aggregates, job["cancelling_at"] is not None)
    counts = {state: 0 for state in ITEM_STATES}
    for agg in aggregates:
        counts[agg.status] = agg.count
    prompt_tokens = sum(a.prompt_tokens for a in aggregates)
    completion_tokens = sum(a.completion_tokens for a in aggregates)
    # Items finished by a worker, the measure of the run's pace; cancelled ones never ran to completion.
    finished_runs = sum(a.ran for a in aggregates if a.status in ("completed", "failed"))
    elapsed = _run_seconds(job, now)
    remaining = counts["queued"] + counts["in_progress"] + counts["waiting"]
    return JobStatus(
        job_id=job["id"],
        name=job["name"],
        task=job["task"],
        model=job["model"],
        status=job["status"],
        timestamps={column: job[column] for column in TIMESTAMP_COLUMNS},
        total=job["total_count"],
        counts=counts,
        completed=counts["completed"],
        failed=counts["failed"],
        cancelled=counts["cancelled"],
        queued=counts["queued"],
        in_progress=counts["in_progress"],
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        tokens_per_s=completion_tokens / elapsed if elapsed else None,
        eta_s=_eta(job["status"], remaining, finished_runs, elapsed),
        results_path=job["results_path"],
        error=job["error"],
    )


def _run_seconds(job: Mapping[str, Any], now: datetime) -> float | None:
    """Seconds the job has spent running: from in_progress_at to the end of the run, or to `now`."""
    started = job["in_progress_at"]
    if started is None:
        return None
    ends = [job[c] for c in _END_OF_RUN_COLUMNS if job[c] is not None]
    seconds = ((min(ends) if ends else now) - started).total_seconds()
    return seconds if seconds > 0 else None


def _eta(status: str, remaining: int, finished_runs: int, elapsed: float | None) -> float | None:
    if status != "in_progress" or not elapsed or finished_runs == 0:
        return None
    return remaining * elapsed / finished_runs
