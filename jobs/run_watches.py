"""When a run of the pipeline should stop: the job stopped handing out work (CancelWatch), or this broker has
waited too long for a stage while other brokers work the job (StrandedWatch)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from layerbus.storage import JobStore
from layerbus.storage.states import RUNNABLE_JOB_STATES

log = logging.getLogger("layerbus.jobs")


def other_workers(store: JobStore, job_id: str, worker_name: str) -> list[str]:
    """The other brokers working the job now (working or finalizing, their leases renewed in time)."""
    now = datetime.now(timezone.utc)
    return [w.worker for w in store.job_workers(job_id)
            if w.worker != worker_name and w.state_at(now) in ("working", "finalizing")]


class StrandedWatch:
    """`should_stop` for the pipeline: true once this broker has waited `grace_s` for a stage to register
    (its chain lost stages and the rest cannot hold the model) while other brokers work the job. A broker
    alone on the job waits for as long as it takes; beside others it would hold its items (renewing their
    leases) while they finish everything else and wait for those items forever. Its run then ends, its
    items go back to the queue, and run_job leaves the job to the others (`_hand_over`)."""

    def __init__(self, store: JobStore, job_id: str, worker_name: str, grace_s: float,
                 clock: Callable[[], float] = time.monotonic, check_every_s: float = 1.0):
        self.store, self.job_id, self.worker_name, self.grace_s = store, job_id, worker_name, grace_s
        self.clock, self.check_every_s = clock, check_every_s
        self.waiting_since: float | None = None
        self.last_check = -math.inf
        self.left, self.reason = False, ""

    def watching(self, record: Callable[..., None]) -> Callable[..., None]:
        """The pipeline's event callback, passed on to `record`, noting when the broker starts and stops waiting."""
        def observe(kind: str, message: str, *args: Any, **fields: Any) -> None:
            if kind == "waiting":
                if self.waiting_since is None:
                    self.waiting_since = self.clock()
                self.reason = message
            elif kind == "recovered":
                self.waiting_since = None
            record(kind, message, *args, **fields)

        return observe

    def __call__(self) -> bool:
        if self.left:
            return True
        now = self.clock()
        if self.waiting_since is None or now - self.waiting_since < self.grace_s or now - self.last_check < self.check_every_s:
            return False
        self.last_check = now
        try:
            others = other_workers(self.store, self.job_id, self.worker_name)
        except Exception:  # noqa: BLE001 (the store unreachable: keep waiting, as a broker alone would)
            log.warning("job %s: could not look for other brokers", self.job_id, exc_info=True)
            return False
        if others:
            self.left = True
            self.reason = f"no stage for {now - self.waiting_since:.0f} s: {self.reason}"
        return self.left


class CancelWatch:
    """`should_stop` for the pipeline: true once the job no longer hands out work (cancelled, failed).

    Reads the store at most every `interval_s`, since the pipeline asks every few milliseconds.
    """

    def __init__(self, store: JobStore, job_id: str, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 states: tuple[str, ...] = RUNNABLE_JOB_STATES):
        self.store, self.job_id, self.interval_s, self.clock = store, job_id, interval_s, clock
        self.states = states  # true once the job's status is none of these
        self.stopping = False
        self.last_check = clock()

    def __call__(self) -> bool:
        now = self.clock()
        if not self.stopping and now - self.last_check >= self.interval_s:
            self.last_check = now
            status = self.store.job_status(self.job_id).status
            if status not in self.states:
                log.info("job %s is %s: finishing the items in flight, claiming no more", self.job_id, status)
                self.stopping = True
        return self.stopping
