"""The two ends of a child process's life that every launcher here shares: dying with its parent, and a
bounded stop (a signal, a wait, then SIGKILL). Standard library only: the stage forker imports it before
torch, and nothing here may start a thread or touch a device."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Protocol, Sequence

log = logging.getLogger("layerbus.cluster")


def die_with_parent() -> None:
    """Ask Linux for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG); elsewhere nothing. Called in a
    child before exec (the setting survives exec), or by a forked stage and the forker itself, so a killed
    broker or `layerbus run` leaves no stage behind."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # without it, orphaned stages still exit once the broker has been silent for --broker-timeout


class Child(Protocol):
    """A started process as stop_children sees it (ChildProcess wraps a Popen or a multiprocessing.Process)."""

    name: str
    pid: int | None

    def alive(self) -> bool: ...

    def wait(self, timeout_s: float) -> bool: ...  # True once it has ended

    def kill(self) -> None: ...


class ChildProcess:
    """A subprocess.Popen or a multiprocessing.Process behind one face."""

    def __init__(self, process, name: str = ""):
        self.process = process
        self.name = name or getattr(process, "name", "") or f"pid {process.pid}"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        if isinstance(self.process, subprocess.Popen):
            return self.process.poll() is None
        return self.process.is_alive()

    def wait(self, timeout_s: float) -> bool:
        if isinstance(self.process, subprocess.Popen):
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        self.process.join(timeout_s)
        return not self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.wait(60.0)


def stop_children(children: Sequence[Child], signum: int, wait_s: float) -> None:
    """Pass `signum` to every child still running, give them `wait_s` in all to end, then SIGKILL the rest."""
    alive = [child for child in children if child.pid is not None and child.alive()]
    for child in alive:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    for child in alive:
        if not child.wait(max(0.1, deadline - time.monotonic())):
            log.warning("%s did not stop within %.0f s of %s: killing it", child.name, wait_s,
                        signal.Signals(signum).name)
            child.kill()
