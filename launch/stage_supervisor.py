"""Watching the local stage processes a LocalCluster started: a child that exits is named with why (how it
ended and its log's last lines); during start-up it is restarted a bounded number of times, then given
up on, so the broker stops waiting for it and plans over the stages it has (broker.control's exits)."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from layerbus.broker.control import StageExit

log = logging.getLogger("layerbus.cluster")

# How many lines of a dead stage's log its message quotes.
LOG_LINES = 5
# How often the processes are looked at (a waitpid each): the broker's loops ask far more often.
CHECK_EVERY_S = 0.25



def ending(returncode: int) -> str:
    """How a process ended, from Popen's returncode (negative: the signal that killed it)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def should_restart(returncode: int, restarts_done: int, max_restarts: int, starting: bool) -> bool:
    """Restart a stage that failed (not one that was asked to stop: code 0) while the cluster starts,
    at most `max_restarts` times; a stage lost mid-job is the broker's to re-plan around."""
    return starting and returncode != 0 and restarts_done < max_restarts


def last_lines(path: Path | None, offset: int, count: int = LOG_LINES) -> str:
    """The last `count` non-empty lines written to `path` since `offset`, joined by " | "."""
    if path is None:
        return "its output went to the broker's stderr"
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            text = handle.read()[-16_384:].decode(errors="replace")
    except OSError as error:
        return f"its log {path} cannot be read: {error.strerror}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-count:]) if lines else f"its log {path} is empty"


class StageSupervisor:
    """The stage processes by name; `check()` reports (and during start-up restarts) those that ended."""

    def __init__(self, spawn: Callable[[int], subprocess.Popen], log_path: Callable[[int], Path | None],
                 count: int, max_restarts: int, clock: Callable[[], float] = time.monotonic, first_stage: int = 0):
        self.spawn, self.log_path, self.max_restarts, self.clock = spawn, log_path, max_restarts, clock
        self.first_stage = first_stage  # process i runs stage-{first_stage + i} (one chain of several)
        self.processes: list[subprocess.Popen] = []
        self.log_offsets: list[int] = []
        self.restarts = [0] * count
        self.given_up: set[str] = set()  # stages that ended and will not come back
        self.watched = count
        self.starting = True  # restarts only until the broker has placed the model
        self.last_check = float("-inf")
        for i in range(count):
            self._start(i)

    def _start(self, i: int) -> None:
        path = self.log_path(i)
        offset = path.stat().st_size if path is not None and path.exists() else 0
        process = self.spawn(i)
        if i < len(self.processes):
            self.processes[i], self.log_offsets[i] = process, offset
        else:
            self.processes.append(process)
            self.log_offsets.append(offset)

    def check(self) -> list[StageExit]:
        """The stages whose process ended since the last check (restarted, when start-up allows)."""
        now = self.clock()
        if now - self.last_check < CHECK_EVERY_S:
            return []
        self.last_check = now
        exits = []
        for i, process in enumerate(self.processes):
            name = f"stage-{self.first_stage + i}"
            if name in self.given_up or process.poll() is None:
                continue
            why = f"{ending(process.returncode)}; {last_lines(self.log_path(i), self.log_offsets[i])}"
            restart = should_restart(process.returncode, self.restarts[i], self.max_restarts, self.starting)
            if restart:
                self.restarts[i] += 1
                log.warning("stage %s (pid %d) %s; restarting it (%d of %d)", name, process.pid, why,
                            self.restarts[i], self.max_restarts)
                self._start(i)
            else:
                self.given_up.add(name)
                log.warning("stage %s (pid %d) %s; not restarted", name, process.pid, why)
            exits.append(StageExit(name, process.pid, why, restart, self.restarts[i]))
        return exits
