"""Start-up that survives, its decisions and the control plane's side, without stage processes: how a
stage process ended, when it is restarted, what its log says, and the broker waiting for the stages that
can still come while the registered ones hear heartbeats (real ZeroMQ sockets in this process)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import zmq

from layerbus.broker.control import ClusterError, ControlPlane, StageState
from layerbus.launch.stage_supervisor import StageExit, StageSupervisor, ending, last_lines, should_restart
from layerbus.wire import protocol
from layerbus.wire.frames import decode, encode


@pytest.mark.parametrize(("returncode", "words"), [
    (-signal.SIGKILL, "killed by SIGKILL"),
    (-signal.SIGSEGV, "killed by SIGSEGV"),
    (1, "exited with code 1"),
    (0, "exited with code 0"),
])
def test_ending_says_how_a_process_ended(returncode, words):
    assert ending(returncode) == words


@pytest.mark.parametrize(("returncode", "restarts_done", "max_restarts", "starting", "restart"), [
    (-9, 0, 2, True, True),
    (1, 1, 2, True, True),
    (1, 2, 2, True, False),  # the budget is spent
    (1, 0, 0, True, False),  # no restarts allowed
    (0, 0, 2, True, False),  # asked to stop: not a failure
    (-9, 0, 2, False, False),  # mid-job: the broker re-plans around it instead
])
def test_a_failed_stage_is_restarted_a_bounded_number_of_times_while_starting(returncode, restarts_done,
                                                                              max_restarts, starting, restart):
    assert should_restart(returncode, restarts_done, max_restarts, starting) is restart


def test_last_lines_are_those_written_since_the_process_started(tmp_path):
    log = tmp_path / "stage-1.log"
    log.write_text("old run: fine\n")
    offset = log.stat().st_size
    log.write_text(log.read_text() + "loading\n\n" + "".join(f"line {i}\n" for i in range(7)))
    assert last_lines(log, offset) == "line 2 | line 3 | line 4 | line 5 | line 6"
    assert last_lines(log, log.stat().st_size) == f"its log {log} is empty"
    assert last_lines(None, 0) == "its output went to the broker's stderr"


class FakeProcess:
    """Popen's poll/returncode/pid, ended by the test."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode


def test_the_supervisor_restarts_then_gives_up_and_reports_each_exit(tmp_path):
    spawned: list[tuple[int, FakeProcess]] = []
    clock = [0.0]

    def spawn(i: int) -> FakeProcess:
        spawned.append((i, FakeProcess(100 + len(spawned))))
        return spawned[-1][1]

    supervisor = StageSupervisor(spawn, lambda i: None, 2, max_restarts=1, clock=lambda: clock[0])
    assert [(i, p.pid) for i, p in spawned] == [(0, 100), (1, 101)]
    assert supervisor.check() == []  # both running
    supervisor.processes[1].returncode = -signal.SIGKILL
    assert supervisor.check() == []  # looked at a moment ago
    clock[0] += 1
    assert supervisor.check() == [StageExit("stage-1", 101, "killed by SIGKILL; its output went to the broker's "
                                            "stderr", restarted=True, restarts=1)]
    assert supervisor.processes[1].pid == 102 and supervisor.given_up == set()
    supervisor.processes[1].returncode = 1
    clock[0] += 1
    (second,) = supervisor.check()
    assert (second.name, second.pid, second.restarted, second.restarts) == ("stage-1", 102, False, 1)
    assert supervisor.given_up == {"stage-1"} and len(spawned) == 3
    clock[0] += 1
    assert supervisor.check() == []  # reported once


# -- the control plane while the stages start ------------------------------------------------------------------


class GivenUp:
    """A ChildWatch whose stages `names` ended for good (no process to look at)."""

    def __init__(self, *names: str, exits: list[StageExit] = ()):
        self.given_up, self.max_restarts, self.pending = set(names), 0, list(exits)

    def check(self) -> list[StageExit]:
        pending, self.pending = self.pending, []
        return pending


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def registered_stage(context, plane: ControlPlane, name: str, pid: int = 7):
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, name.encode())
    dealer.connect(plane.address)
    dealer.send_multipart(encode({"kind": protocol.REGISTER, "name": name, "device": "cpu", "dtype": "float32",
                                  "threads": 1, "data_address": "tcp://127.0.0.1:1", "pid": pid, "host": "h"}))
    return dealer


def test_the_broker_waits_only_for_stages_that_can_still_come_and_heartbeats_the_others(context):
    plane = ControlPlane(context)
    plane.children = GivenUp("stage-1")
    first, last = registered_stage(context, plane, "stage-0"), registered_stage(context, plane, "stage-2")
    stages = plane.wait_for_stages(3, timeout_s=60)
    assert sorted(stage.name for stage in stages) == ["stage-0", "stage-2"]
    for dealer in (first, last):  # registered stages hear from the broker while it waits: they stay
        assert dealer.poll(5000) and decode(dealer.recv_multipart(), 1 << 20).kind == protocol.HEARTBEAT


def test_waiting_out_the_timeout_gives_true_counts_and_names_who_left(context):
    plane = ControlPlane(context)
    ended = StageExit("stage-2", 31, "killed by SIGKILL; out of memory", restarted=True, restarts=1)
    plane.children = GivenUp(exits=[ended])
    dealers = [registered_stage(context, plane, "stage-0"), registered_stage(context, plane, "stage-1", pid=30)]
    for _ in range(50):  # both registrations read (each poll returns once something came)
        if len(plane.stages) == len(dealers):
            break
        plane.poll(200)
    plane.stage("stage-1").state = StageState.GONE
    plane.stage("stage-1").error = "its process exited with code 1"
    with pytest.raises(ClusterError) as raised:
        plane.wait_for_stages(3, timeout_s=0.5)
    assert str(raised.value).startswith(
        "1 of 3 stages registered and alive after 0 s at " + plane.address + "; stage-1 registered, then its process "
        "exited with code 1; stage-2 (pid 31) killed by SIGKILL; out of memory; start more with `layerbus stage")


def test_a_child_that_ended_is_gone_at_once_with_why_and_its_restart_is_a_new_stage(context):
    plane = ControlPlane(context)
    dealers = [registered_stage(context, plane, "stage-0", pid=40)]
    plane.poll(2000)
    plane.children = GivenUp(exits=[StageExit("stage-0", 40, "killed by SIGKILL; loading", True, 1)])
    events = plane.poll(0)
    assert [(e.kind, e.stage) for e in events] == [("bye", "stage-0")]
    stage = plane.stage("stage-0")
    assert stage.state is StageState.GONE and stage.error == "its process killed by SIGKILL; loading"
    dealers.append(registered_stage(context, plane, "stage-0", pid=41))  # the restarted process
    for _ in range(50):
        if plane.stage("stage-0").pid == 41:
            break
        plane.poll(200)
    assert plane.stage("stage-0").state is StageState.SPARE and plane.stage("stage-0").pid == 41
