"""Registrations as the broker's control plane judges them (broker/control.py): a stage registers on every
connection and again until answered, so the same process registering twice changes nothing; another process
under a known name (a supervisor restarted it faster than the liveness window) makes the one the chain knew
gone at once; a stage told to register again after it was presumed lost comes back as a new spare; a spare
that ended, left or was restarted is said lost once."""

from __future__ import annotations

import zmq

from layerbus.broker.control import ControlPlane, StageState, lost_reason
from layerbus.broker.control_io import read_arrival
from layerbus.wire import protocol
from layerbus.wire.frames import encode


def frames(identity: bytes, header: dict) -> list:
    return [zmq.Frame(identity), *(zmq.Frame(bytes(memoryview(f))) for f in encode(header))]


def register(plane: ControlPlane, pid: int, at: float, name: str = "stage-x", port: int = 1) -> None:
    header = {"kind": protocol.REGISTER, "name": name, "device": "cpu", "dtype": "float32", "threads": 1,
              "data_address": f"tcp://127.0.0.1:{port}", "pid": pid, "host": "h"}
    plane._handle(read_arrival(frames(name.encode(), header), at))


def plane() -> ControlPlane:
    return ControlPlane(zmq.Context.instance(), "tcp://127.0.0.1:*")


def test_the_same_process_registering_again_changes_nothing():
    control = plane()
    try:
        register(control, pid=7, at=1.0)
        stage = control.stage("stage-x")
        stage.state = StageState.READY
        register(control, pid=7, at=2.0)
        assert control.stage("stage-x") is stage and stage.state is StageState.READY and stage.last_seen == 2.0
        assert control.registered == 1
    finally:
        control.close()


def test_another_process_under_a_known_name_makes_the_first_gone_at_once():
    control = plane()
    try:
        register(control, pid=7, at=1.0)
        first = control.stage("stage-x")
        first.state = StageState.READY
        register(control, pid=8, at=1.5, port=2)  # within any liveness window
        second = control.stage("stage-x")
        assert second is not first and second.state is StageState.SPARE and second.pid == 8
        assert control.registered == 2, "a broker waiting for a stage to register counts this one (same name)"
        assert first.state is StageState.GONE
        assert lost_reason(first, 1.5, 5.0, 300.0) == "restarted: a new process (pid 8) registered under its name"
    finally:
        control.close()


def test_a_stage_told_to_register_again_comes_back_as_a_new_spare():
    control = plane()
    try:
        register(control, pid=7, at=1.0)
        first = control.stage("stage-x")
        control.mark_lost(first)
        control._handle(read_arrival(frames(b"stage-x", {"kind": protocol.HEARTBEAT}), 2.0))  # it speaks: RESET
        assert first.state is StageState.RESET
        register(control, pid=7, at=3.0)
        again = control.stage("stage-x")
        assert again is not first and again.state is StageState.SPARE
    finally:
        control.close()


class Keeper:
    """What Replanner.check_spares reads of a ChainKeeper: the control plane, the chain, the counters."""

    def __init__(self, control: ControlPlane, chain: list):
        from layerbus.broker.run_state import BrokerCounts

        self.control, self.chain, self.counts, self.forgotten = control, chain, BrokerCounts(), []

    def forget(self, stage) -> None:
        self.forgotten.append(stage.name)
        self.control.mark_lost(stage)


def spares_lost(control: ControlPlane, chain: list, at: float) -> list[str]:
    from layerbus.broker.replanning import Replanner

    said = []
    control.clock = lambda: at
    Replanner(Keeper(control, chain), lambda: 0).check_spares(5.0, 300.0, lambda kind, message, **_: said.append(
        (kind, message)))
    assert all(kind == "stage_lost" for kind, _ in said)
    return [message for _, message in said]


def test_a_spare_restarted_under_its_name_is_said_lost_once():
    """The restart replaces the spare's record before any liveness window could find it silent; no chain holds
    it: the broker still says it was lost, once."""
    control = plane()
    try:
        register(control, pid=7, at=1.0, name="spare")
        register(control, pid=1, at=1.0, name="in-chain", port=3)
        member = control.stage("in-chain")
        member.state = StageState.READY
        register(control, pid=8, at=1.5, name="spare", port=2)
        assert spares_lost(control, [member], at=1.6) == [
            "stage spare (h pid 7), a spare, lost: restarted: a new process (pid 8) registered under its name"]
        assert spares_lost(control, [member], at=1.7) == []
        assert control.stage("spare").pid == 8 and control.stage("spare").state is StageState.SPARE
    finally:
        control.close()


def test_a_spare_whose_process_ended_is_said_lost_and_a_chain_stage_is_left_to_the_chain():
    """The launcher says a stage process ended (a local cluster's supervisor, Slurm's exit files): a spare is said
    lost at once; a stage of the chain is the chain's watch's to say (check_stages), not said twice."""
    from layerbus.broker.control import StageExit

    class Ended:
        given_up, watched, max_restarts = set(), 2, 0

        def __init__(self):
            self.pending = [StageExit("spare", 7, "its task ended with exit code 137", restarted=False, restarts=0),
                            StageExit("in-chain", 1, "its task ended with exit code 137", restarted=False,
                                      restarts=0)]

        def check(self):
            pending, self.pending = self.pending, []
            return pending

    control = plane()
    try:
        register(control, pid=7, at=1.0, name="spare")
        register(control, pid=1, at=1.0, name="in-chain", port=3)
        member = control.stage("in-chain")
        member.state = StageState.READY
        control.children = Ended()
        control.poll()
        assert spares_lost(control, [member], at=1.1) == [
            "stage spare (h pid 7), a spare, lost: its task ended with exit code 137"]
        assert member.state is StageState.GONE and lost_reason(member, 1.1, 5.0, 300.0) is not None
    finally:
        control.close()
