"""A stage's link to its broker (stages/broker_link.py), against a ROUTER socket played by the test, in this
process: a stage waits for a broker that is not bound yet, registers as soon as a connection is made and
again (with back-off) until answered, gives up only after --wait-for-broker, counts --broker-timeout from the
broker's last message once it has spoken, says what the broker is busy with once, and registers again with a
broker that comes up on the same address after the first went away."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from layerbus.stages.broker_link import BrokerLink, LinkConfig
from layerbus.wire import protocol
from layerbus.wire.frames import decode, encode
from tests.helpers.processes import free_port_pair

REGISTRATION = {"name": "s0", "device": "cpu", "dtype": "float32", "threads": 1, "data_address": "tcp://127.0.0.1:1",
                "pid": 7, "host": "h"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def make_link(context, port: int, clock: Clock, **config) -> BrokerLink:
    link = BrokerLink(context, LinkConfig(f"tcp://127.0.0.1:{port}", heartbeat_interval_s=60.0, **config), "s0",
                      lambda: {"stats": {}}, clock=clock)
    link.registration = dict(REGISTRATION)
    link.connect()
    return link


def router(context, port: int) -> zmq.Socket:
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(f"tcp://127.0.0.1:{port}")
    return socket


def registrations(broker: zmq.Socket, link: BrokerLink, wait_s: float = 5.0) -> int:
    """REGISTERs the broker got from the link's control socket within `wait_s` (the link checked meanwhile)."""
    count, deadline = 0, time.monotonic() + wait_s
    while time.monotonic() < deadline:
        link.check()
        while broker.poll(50):
            frames = broker.recv_multipart()
            if not frames[0].endswith(protocol.HEARTBEAT_IDENTITY_SUFFIX) and decode(frames[1:]).kind == protocol.REGISTER:
                count += 1
        if count:
            return count
    return count


def test_a_stage_waits_for_a_broker_that_is_not_up_and_registers_when_it_comes(context):
    clock, port = Clock(), free_port_pair()
    link = make_link(context, port, clock, broker_timeout_s=2.0)
    clock.now += 3600.0  # an hour, many broker timeouts: no broker has spoken, so none has fallen silent
    assert link.check() is None and not link.admitted
    broker = router(context, port)
    assert registrations(broker, link) >= 1, "registered once the connection was made"
    broker.send_multipart([b"s0", *encode({"kind": protocol.HEARTBEAT})])
    deadline = time.monotonic() + 5
    while not link.admitted and time.monotonic() < deadline:
        link.socket.poll(100)
        link.receive()
    assert link.admitted
    clock.now += 2.5  # now its silence counts
    assert link.check().code == 3
    link.close({})


def test_it_registers_again_with_back_off_until_the_broker_answers(context):
    clock, port = Clock(), free_port_pair()
    broker = router(context, port)
    link = make_link(context, port, clock)
    assert registrations(broker, link) == 1
    clock.now += 0.5
    assert registrations(broker, link, wait_s=0.3) == 0, "not before its back-off"
    clock.now += 0.6
    assert registrations(broker, link) == 1, "again after 1 s without an answer"
    clock.now += 1.5
    assert registrations(broker, link, wait_s=0.3) == 0, "the next after 2 s"
    clock.now += 0.6
    assert registrations(broker, link) == 1
    link.close({})


def test_wait_for_broker_bounds_the_wait(context):
    clock, port = Clock(), free_port_pair()
    link = make_link(context, port, clock, wait_for_broker_s=30.0)
    clock.now += 29.0
    assert link.check() is None
    clock.now += 2.0
    gone = link.check()
    assert gone.code == 3 and "--wait-for-broker 30 s" in gone.why
    link.close({})


def test_what_the_broker_is_busy_with_is_said_once(context, caplog):
    clock, port = Clock(), free_port_pair()
    broker = router(context, port)
    link = make_link(context, port, clock)
    assert registrations(broker, link) == 1
    for phase in ("preparing the model", "preparing the model", "planning"):
        broker.send_multipart([b"s0", *encode({"kind": protocol.WAIT, "phase": phase, "next_s": 0.5})])
    with caplog.at_level(logging.INFO, logger="layerbus.stage"):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and "planning" not in caplog.text:
            link.socket.poll(100)
            assert all(message.kind != protocol.WAIT for message in link.receive()), "WAIT is the link's own"
    busy = [r.getMessage() for r in caplog.records if "the broker is busy" in r.getMessage()]
    assert busy == ["stage s0: the broker is busy: preparing the model; it speaks again within 0.5 s",
                    "stage s0: the broker is busy: planning; it speaks again within 0.5 s"]
    link.close({})


def test_a_broker_that_comes_back_on_the_address_gets_a_new_registration(context):
    clock, port = Clock(), free_port_pair()
    broker = router(context, port)
    link = make_link(context, port, clock)
    assert registrations(broker, link) == 1
    broker.close(linger=0)
    time.sleep(0.3)
    broker = router(context, port)  # a broker restarted on the same address knows nothing of this stage
    assert registrations(broker, link, wait_s=10.0) >= 1
    link.close({})
