"""Starting local stage processes by forking them from a launcher that has imported their libraries once
(launch/stage_forker.py), instead of a fresh interpreter each: a stage then starts in milliseconds instead
of seconds of importing torch and transformers. `ForkedStage` answers what the broker and its callers ask
of a `subprocess.Popen` (pid, poll, wait, returncode, signals), so the supervisor does not know which.

One launcher serves every local cluster this process starts (`shared_launcher()`): a test session or a
benchmark that starts many clusters imports the libraries once. Each stage gets the environment and
arguments it would have had from Popen; the launcher's own environment only decides how the libraries
were imported, and those read no layerbus setting at import.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from layerbus.launch.process_life import die_with_parent
from layerbus.models.openmp_waits import with_passive_waits

log = logging.getLogger("layerbus.cluster")

READY_TIMEOUT_S = 300.0  # importing torch on a loaded machine; a launcher slower than this is broken


class LauncherError(RuntimeError):
    """The launcher could not start or answer; the caller falls back to plain processes."""


class ForkedStage:
    """A stage process the launcher forked: the parts of subprocess.Popen that the broker uses."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, returncode: int) -> None:
        self.returncode = returncode
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # as Popen: never signal a pid that may have been reused
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class StageLauncher:
    """A `python -m layerbus.launch.stage_forker` child; `spawn()` forks a stage from it."""

    def __init__(self, env: dict[str, str] | None = None):
        # Its OpenMP threads are its stages' (libgomp reads its settings as torch loads, in the launcher).
        env = with_passive_waits(os.environ if env is None else env)
        self.process = subprocess.Popen([sys.executable, "-m", "layerbus.launch.stage_forker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, start_new_session=True,
                                        preexec_fn=die_with_parent)
        self.lock = threading.Lock()  # one spawn at a time: requests and their answers go in order
        self.started: dict[int, dict] = {}
        self.children: dict[int, ForkedStage] = {}
        self.ended: dict[int, int] = {}  # exits reported before their spawn() registered the pid
        self.answers = threading.Condition()
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, name="stage-launcher", daemon=True)
        self.reader.start()

    def alive(self) -> bool:
        return self.process.poll() is None

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self.answers:
                if "started" in message:
                    self.started[message["started"]] = message
                elif "ended" in message:
                    child = self.children.pop(message["ended"], None)
                    if child is not None:
                        child._end(message["returncode"])
                    else:
                        self.ended[message["ended"]] = message["returncode"]
                self.answers.notify_all()
        with self.answers:  # the launcher is gone: so are its children (PR_SET_PDEATHSIG)
            for child in self.children.values():
                child._end(-signal.SIGTERM)
            self.children.clear()
            self.answers.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], stderr: Path | None) -> ForkedStage:
        """A stage process running `python -m layerbus.stages ARGV` with `env` in this process's working
        folder, its stderr appended to `stderr` (None: the launcher's, which is this process's)."""
        with self.lock:
            request_id, self.next_id = self.next_id, self.next_id + 1
            request = {"spawn": request_id, "argv": argv, "env": env, "cwd": os.getcwd(),
                       "stderr": str(stderr) if stderr else None}
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError) as error:
                raise LauncherError(f"the stage launcher (pid {self.process.pid}) is gone: {error}") from None
            with self.answers:
                if not self.answers.wait_for(lambda: request_id in self.started or not self.reader.is_alive(),
                                             READY_TIMEOUT_S):
                    raise LauncherError(f"the stage launcher (pid {self.process.pid}) did not answer in "
                                        f"{READY_TIMEOUT_S:.0f} s")
                answer = self.started.pop(request_id, None)
                if answer is None or "error" in answer:
                    why = answer["error"] if answer else f"it ended ({self.process.poll()})"
                    raise LauncherError(f"the stage launcher could not start a stage: {why}")
                child = ForkedStage(answer["pid"], [sys.executable, "-m", "layerbus.stages", *argv])
                if answer["pid"] in self.ended:  # it ended before we got here
                    child._end(self.ended.pop(answer["pid"]))
                else:
                    self.children[answer["pid"]] = child
                return child

    def close(self) -> None:
        """Stop taking requests; the launcher exits once the stages it started have ended."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_shared: StageLauncher | None = None
_shared_lock = threading.Lock()


def shared_launcher() -> StageLauncher:
    """This process's launcher, started on first use (and again if it died)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive():
            _shared = StageLauncher()
            atexit.register(_shared.close)
        return _shared


def warm_up() -> None:
    """Start this process's launcher now, where stages are forked: its imports of torch and transformers
    (seconds) then overlap with what this process does before it starts stages (reading tasks or inputs,
    tokenizing, queueing, planning), instead of following it. Never fails: a launcher that cannot start is
    found again, and fallen back from, when a stage is spawned."""
    if not forking_supported():
        return
    try:
        shared_launcher()
    except Exception:  # noqa: BLE001 (an optimisation: spawn() reports the real problem)
        log.debug("the stage launcher did not start early", exc_info=True)


def forking_supported(environ=os.environ) -> bool:
    """Linux, and not turned off with LAYERBUS_FORK_STAGES=0 (a device driver that dislikes fork, or to
    compare start-up times)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux") and environ.get("LAYERBUS_FORK_STAGES") != "0"

