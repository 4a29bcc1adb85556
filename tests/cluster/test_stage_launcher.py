"""Stages forked from the launcher (launch/stage_launcher.py, launch/stage_forker.py) behave as processes
started fresh: their arguments, environment, working folder and log are theirs; exits and signals are
reported as subprocess.Popen reports them; and when the launcher dies its stages die with it."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import zmq

from layerbus.launch.stage_launcher import StageLauncher, forking_supported

pytestmark = pytest.mark.skipif(not forking_supported({}), reason="the launcher forks: Linux only")


@pytest.fixture(scope="module")
def launcher():
    launcher = StageLauncher()
    yield launcher
    launcher.close()


def silent_broker() -> tuple[zmq.Socket, str]:
    """A ROUTER nobody answers on: a stage given it registers and then waits."""
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    return socket, f"tcp://127.0.0.1:{port}"


def test_a_stage_gets_its_own_arguments_folder_and_log(launcher, tmp_path, monkeypatch):
    # Its environment too: tests/cluster/test_faults.py's poison item and tests/cluster/test_startup_faults.py's held
    # load reach forked stages only through the environment their cluster gives them.
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "stage.log"
    broker, address = silent_broker()
    try:
        stage = launcher.spawn(["--broker", address, "--name", "forked-0", "--broker-timeout", "600"],
                               dict(os.environ), log)
        assert broker.poll(60_000), "the forked stage never registered"
        identity, *frames = broker.recv_multipart()
        assert b"forked-0" in b"".join(frames)
        assert os.readlink(f"/proc/{stage.pid}/cwd") == str(tmp_path)
        stage.terminate()
        assert stage.wait(60) == 128 + signal.SIGTERM, "a stage stopped by SIGTERM says so, as a fresh one does"
    finally:
        broker.close(0)
    assert not os.path.exists(f"/proc/{stage.pid}"), "the process is gone, and reaped by the launcher"
    assert "forked-0" in log.read_text(), "the stage's log went to its own file"


def test_an_argument_error_is_its_exit_code_and_its_log(launcher, tmp_path):
    log = tmp_path / "bad.log"
    stage = launcher.spawn(["--broker", "tcp://127.0.0.1:1", "--dtype", "float99"], dict(os.environ), log)
    assert stage.wait(60) == 2
    assert "float99" in log.read_text()


def test_signals_reach_the_forked_process_and_its_end_reads_as_popen_reads_it(launcher, tmp_path):
    broker, address = silent_broker()
    try:
        stage = launcher.spawn(["--broker", address, "--name", "forked-1", "--broker-timeout", "600"],
                               dict(os.environ), tmp_path / "killed.log")
        assert broker.poll(60_000), "the forked stage never registered"
        assert stage.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            stage.wait(0.1)
        os.kill(stage.pid, signal.SIGKILL)
        assert stage.wait(60) == -signal.SIGKILL
        stage.kill()  # as Popen: signalling a process that has ended does nothing
    finally:
        broker.close(0)


def test_stages_die_with_a_killed_launcher(tmp_path):
    launcher = StageLauncher()
    broker, address = silent_broker()
    try:
        stage = launcher.spawn(["--broker", address, "--name", "forked-2", "--broker-timeout", "600"],
                               dict(os.environ), tmp_path / "orphan.log")
        assert broker.poll(60_000), "the forked stage never registered"
        launcher.process.kill()
        launcher.process.wait()
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{stage.pid}") and _state(stage.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{stage.pid}") or _state(stage.pid) == "Z", \
            "a stage outlived its launcher (PR_SET_PDEATHSIG)"
        assert stage.wait(60) is not None
    finally:
        broker.close(0)
        launcher.close()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_the_launcher_and_so_its_stages_wait_passively_between_operations(monkeypatch):
    """libgomp reads OMP_WAIT_POLICY when torch loads, in the launcher: its environment decides for every
    stage forked from it (models/openmp_waits.py: spinning threads took the cores of the processes beside them)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    launcher = StageLauncher()
    try:
        with open(f"/proc/{launcher.process.pid}/environ", "rb") as environ:
            assert b"OMP_WAIT_POLICY=PASSIVE" in environ.read().split(b"\0")
    finally:
        launcher.close()


def test_warm_up_starts_the_shared_launcher_at_once_and_only_where_stages_are_forked(monkeypatch):
    """`run` and `eval run` call warm_up first thing, so the launcher's imports overlap their own work: the
    launcher process is running when it returns (it does not wait for the imports), and the one spawn() uses."""
    import layerbus.launch.stage_launcher as launching

    monkeypatch.setattr(launching, "_shared", None)
    monkeypatch.setenv("LAYERBUS_FORK_STAGES", "0")
    launching.warm_up()
    assert launching._shared is None, "not forking: nothing to start"
    monkeypatch.delenv("LAYERBUS_FORK_STAGES")
    launching.warm_up()
    started = launching._shared
    try:
        assert started is not None and started.alive()
        assert launching.shared_launcher() is started
    finally:
        started.close()
        monkeypatch.setattr(launching, "_shared", None)
