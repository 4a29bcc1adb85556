"""Tokens generated over time, per running job, as the server sees them: the keeper records each running job's
generated-token count every second (from the store's counters, never the items), and a job page draws the
rate between samples. Held in memory, a bounded number per job: the chart covers what this server watched."""

from __future__ import annotations

import threading
from collections import deque

# Samples kept per job: an hour at one a second, then the oldest go.
MAX_SAMPLES = 3600
# Jobs followed at once; the least recently sampled one is dropped past it.
MAX_JOBS = 64


class TokenSamples:
    """(unix seconds, completion tokens) per job; safe to use from the keeper's thread and the request threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, deque[tuple[float, int]]] = {}

    def record(self, job_id: str, at: float, tokens: int) -> None:
        with self._lock:
            samples = self._jobs.pop(job_id, None) or deque(maxlen=MAX_SAMPLES)
            if not samples or samples[-1][1] != tokens or at - samples[-1][0] >= 5:
                samples.append((at, tokens))
            self._jobs[job_id] = samples  # the most recently sampled last
            while len(self._jobs) > MAX_JOBS:
                del self._jobs[next(iter(self._jobs))]

    def rates(self, job_id: str) -> list[tuple[float, float]]:
        """(seconds since the first sample, tokens/s since the sample before) for each sample after the first."""
        with self._lock:
            samples = list(self._jobs.get(job_id, ()))
        if len(samples) < 2:
            return []
        start = samples[0][0]
        return [(t - start, (n - n0) / (t - t0)) for (t0, n0), (t, n) in zip(samples, samples[1:]) if t > t0]
