"""`python -m layerbus.launch.stage_forker`: a process that imports a stage's libraries once and forks stage
processes from itself, for a broker that starts its stages on its own machine (launch.stage_launcher).

Importing torch and transformers' modeling code is most of a stage's start: 3.5 s of CPU here, paid by
every stage process a `layerbus run` (or a restart after a crash at start-up) starts, and by every
cluster a test session starts. A fork of a process that has imported them and done nothing else costs
milliseconds. "Nothing else" matters: no thread, no torch operation, no CUDA and no ZeroMQ context is
ever created here, so a child starts as a fresh process would (its own threads, its own device).

The requests and answers are JSON lines over this process's stdin and stdout; nothing is pickled:
  -> {"spawn": ID, "argv": [...], "env": {...}, "cwd": PATH, "stderr": PATH or null}
  <- {"ready": true}                      once the libraries are imported
  <- {"started": ID, "pid": PID}           (or {"started": ID, "error": "..."})
  <- {"ended": PID, "returncode": CODE}    negative: the signal that ended it, as subprocess reports it
The launcher exits when its stdin closes. Each child asks Linux for SIGTERM when the launcher dies
(PR_SET_PDEATHSIG), and the launcher asks the same of its own parent, so a killed broker leaves no
stage behind, as with stages it started itself.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
import traceback

from layerbus.launch.process_life import die_with_parent

PRELOAD = ("layerbus.stages.worker", "layerbus.stages.__main__")  # what `python -m layerbus.stages` imports

def _resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0



def returncode(status: int) -> int:
    """A wait status as subprocess.Popen.returncode: the exit code, or minus the signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict, launcher_pid: int, launcher_fds: tuple[int, ...]) -> None:
    """In the forked child: become the stage process `request` describes; never returns."""
    code = 1
    try:
        from layerbus.stages import host

        host.inherited_rss_bytes = _resident_bytes(launcher_pid)
        os.setsid()  # its own session, as the broker's Popen(start_new_session=True) gave it
        die_with_parent()
        if os.getppid() != launcher_pid:  # the launcher died between fork and prctl
            os._exit(1)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL if signum != signal.SIGPIPE else signal.SIG_IGN)
        signal.set_wakeup_fd(-1)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # as the broker's Popen: the stage's output is its log on stderr
        if request.get("stderr"):
            log = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(log, 2)
            os.close(log)
        os.close(devnull)
        for fd in launcher_fds:
            if fd > 2:
                os.close(fd)  # the launcher's pipes and selector are not the stage's
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.executable, "-m", "layerbus.stages", *request["argv"]]
        from layerbus.stages.__main__ import main

        code = main(list(request["argv"]))
    except SystemExit as done:  # argparse's errors, sys.exit in the stage
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, (int, type(None))):
            print(done.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _answer(out: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(out, data):]


def serve(inp: int, out: int) -> int:
    """Answer spawn requests read from file descriptor `inp` (JSON lines) until it closes; report the
    children started and ended on `out`."""
    die_with_parent()
    for module in PRELOAD:
        __import__(module)
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the broker, which stops its stages in order
    selector = selectors.DefaultSelector()
    selector.register(inp, selectors.EVENT_READ, "request")
    selector.register(wakeup_r, selectors.EVENT_READ, "child")
    inherited = (inp, out, wakeup_r, wakeup_w, selector.fileno())
    me = os.getpid()
    _answer(out, {"ready": True})
    children: set[int] = set()
    pending = b""
    reading = True
    while reading or children:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "child":
                os.read(wakeup_r, 4096)
                continue
            chunk = os.read(inp, 65536)
            if not chunk:
                reading = False  # the broker closed us: wait for the children it has not stopped yet
                selector.unregister(inp)
                continue
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as error:
                    _answer(out, {"started": request["spawn"], "error": str(error)})
                    continue
                if pid == 0:
                    _child(request, me, inherited)
                children.add(pid)
                _answer(out, {"started": request["spawn"], "pid": pid})
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                children.discard(pid)
                if reading:
                    _answer(out, {"ended": pid, "returncode": returncode(status)})
    return 0


def main() -> int:
    # The requests come on stdin; answers go on a copy of stdout, and stdout itself becomes stderr, so
    # nothing an imported library prints can corrupt the answers.
    answers = os.dup(1)
    os.dup2(2, 1)
    return serve(0, answers)


if __name__ == "__main__":
    sys.exit(main())
