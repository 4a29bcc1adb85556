"""Registrations as the broker's control plane judges them (broker/control.py): a stage registers on every
connection and again until answered, so the same process registering twice changes nothing; another process
under a known name (a supervisor restarted it faster than the liveness window) makes the one the chain knew
gone at once; a stage told to register again after it was presumed lost comes back as a new spare."""

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
