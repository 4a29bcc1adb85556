"""`--emulate-speed F`: a stage that serves as a device F times this one's speed would.

Such a device takes (what this step costs this host alone) / F, however busy the host's other cores
are: a slow GPU's step does not stretch because a neighbour's process computes. On a one-thread CPU
stage the step's CPU time is what it costs alone (a thread waiting for a core is not charged for the
wait), so the stage sleeps until cpu / F has passed since the step began. Timing the
sleep by the step's wall time instead would let the host's contention stretch the sleep too: four emulated stages in one chain start their steps together, so their compute phases
overlap, and each step's wall-clock compute, then its sleep, grew 1.45x over what the stages measured
alone (one chain of four at 0.4 of a core on two cores: 54 tok/s, where 76 with this rule); the devices
they stand for would not slow at all. A step whose wall time already exceeds cpu / F (the host is
short of cores beyond what F leaves) does not sleep. Elsewhere the step's wall time stands for its cost
alone: a GPU stage's host thread waits for the device, so its CPU time says nothing; and with
several torch threads the serving thread's own CPU time is its share of the work, 83-93% of the step's
wall time alone here (2 threads), so it would make the stage faster than its profile says.
"""

from __future__ import annotations

import time


def cpu_clock(device: str, threads: int) -> float | None:
    """The serving thread's CPU seconds on a one-thread CPU stage, where they are its step's cost alone;
    None elsewhere (the step's wall time stands for it)."""
    return time.thread_time() if device == "cpu" and threads == 1 else None


def emulated_sleep_s(wall_s: float, cpu_s: float | None, speed: float) -> float:
    """How long to sleep after a step that took `wall_s` on the clock and `cpu_s` of the serving thread's
    CPU (None: not a CPU stage), so that it lasts as long as on a device at `speed` (0 < speed <= 1) of
    this one's."""
    if speed >= 1.0:
        return 0.0
    alone = wall_s if cpu_s is None else cpu_s
    return max(0.0, alone / speed - wall_s)


class StepTimer:
    """A step's start on the clock and, on a one-thread CPU stage, on the serving thread's CPU clock: what
    the worker and the co-run probe both need to sleep the rest of an emulated step."""

    def __init__(self, device: str, threads: int):
        self.device, self.threads = device, threads
        self.started = time.monotonic()
        self.cpu_started = cpu_clock(device, threads)

    def sleep_s(self, speed: float) -> float:
        """How long to sleep now so that the step lasts as long as on a device at `speed` of this one's."""
        now = cpu_clock(self.device, self.threads)
        cpu_s = None if self.cpu_started is None or now is None else now - self.cpu_started
        return emulated_sleep_s(time.monotonic() - self.started, cpu_s, speed)
