"""The job and item lifecycles as plain values: which states exist and which moves between them are legal.

Job states are the OpenAI Batch API's. The table is pure data so that the store, the CLI and the tests
agree on one lifecycle; `JobStore.set_job_status` and `JobStore.cancel_job` enforce it.
"""

from __future__ import annotations

from layerbus.storage.errors import StoreError

JOB_STATES = (
    "validating",
    "queued",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "cancelling",
    "cancelled",
)
# waiting: a part of a long document whose result is made from other items' outputs (a reduce, a join);
# it becomes queued, completed or failed in the transaction that finishes the last of them.
ITEM_STATES = ("queued", "in_progress", "completed", "failed", "cancelled", "waiting")
FINISH_REASONS = ("stop", "length", "error", "cancelled")

# Items not finished yet: runnable, running, or waiting for the items their result is made from.
UNFINISHED_ITEM_STATES = ("queued", "in_progress", "waiting")
# Items in these states have their final result in the store.
FINISHED_ITEM_STATES = ("completed", "failed", "cancelled")
# Jobs in these states are over: a run has nothing left to do, and `status --watch` stops.
FINAL_JOB_STATES = ("completed", "failed", "cancelled")
# Jobs in these states still have items for a broker to claim.
RUNNABLE_JOB_STATES = ("queued", "in_progress")
# Jobs in these states can be cancelled; later ones have no queued work left to stop.
CANCELLABLE_JOB_STATES = ("validating", "queued", "in_progress")

# Moves `set_job_status` accepts. Moves into cancelling/cancelled go through `cancel_job`, which also
# cancels the queued items; only the last step (cancelling -> cancelled) is open to callers.
JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    "validating": frozenset({"queued", "failed"}),
    "queued": frozenset({"in_progress", "failed"}),
    "in_progress": frozenset({"finalizing", "failed"}),
    "finalizing": frozenset({"completed", "failed"}),
    "cancelling": frozenset({"cancelled", "failed"}),
    "completed": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}


def timestamp_column(state: str) -> str:
    """The jobs column stamped when a job enters `state` (validating is the job's creation)."""
    if state not in JOB_STATES:
        raise StoreError(f"unknown job state {state!r}; job states are: {', '.join(JOB_STATES)}")
    return "created_at" if state == "validating" else f"{state}_at"


# One timestamp column per job state, in lifecycle order.
TIMESTAMP_COLUMNS = tuple(timestamp_column(s) for s in JOB_STATES)


def check_job_transition(job_id: str, current: str, target: str) -> None:
    """Raise StoreError unless `set_job_status` may move job `job_id` from `current` to `target`."""
    if target not in JOB_STATES:
        raise StoreError(f"unknown job state {target!r}; job states are: {', '.join(JOB_STATES)}")
    if target in JOB_TRANSITIONS[current]:
        return
    allowed = ", ".join(sorted(JOB_TRANSITIONS[current])) or "none: it is final"
    hint = "; use cancel_job() to cancel a job" if target in ("cancelling", "cancelled") else ""
    raise StoreError(
        f"job {job_id!r} cannot move from {current} to {target} (moves from {current}: {allowed}){hint}"
    )


def check_finish_reason(item_id: int, finish_reason: str) -> None:
    """Raise StoreError unless `finish_reason` is one the results format knows."""
    if finish_reason not in FINISH_REASONS:
        raise StoreError(
            f"item {item_id}: unknown finish_reason {finish_reason!r}; use one of {', '.join(FINISH_REASONS)}"
        )
