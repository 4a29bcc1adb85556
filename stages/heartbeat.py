"""A stage's heartbeats, sent from a thread of their own.

The stage's main loop is busy for the whole of a step or a load (seconds on a large span), so
heartbeats sent between steps would make a slow stage look dead. This thread sends one every
interval on its own DEALER socket (ZeroMQ sockets belong to one thread), whatever the main loop is
doing. A stopped process (SIGSTOP) or a killed one stops its heartbeats too, which is what the
broker's liveness window detects. A hung main loop does not: each heartbeat therefore says for how
long the current step or load has been running (`busy_s`), so the broker can tell "alive and
working" from "alive and stuck".
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import zmq

from layerbus.wire import protocol
from layerbus.wire.frames import encode
from layerbus.wire.protocol import HEARTBEAT_IDENTITY_SUFFIX


class HeartbeatThread(threading.Thread):
    def __init__(self, context: zmq.Context, broker: str, identity: bytes, interval_s: float,
                 describe: Callable[[], dict], secure: Callable[[zmq.Socket], None] = lambda socket: None):
        super().__init__(name="layerbus-heartbeat", daemon=True)
        self.context, self.broker, self.identity, self.interval_s = context, broker, identity, interval_s
        self.describe = describe  # the fields of each heartbeat (stats, busy_s), read from the main loop's state
        self.secure = secure  # makes the socket a CURVE client of the broker, as the stage's control socket is
        self.stopped = threading.Event()

    def run(self) -> None:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self.identity + HEARTBEAT_IDENTITY_SUFFIX)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 4)  # a broker that is away needs no backlog of stale heartbeats
        self.secure(socket)
        socket.connect(self.broker)
        try:
            while not self.stopped.wait(self.interval_s):
                try:
                    socket.send_multipart(encode(dict(self.describe(), kind=protocol.HEARTBEAT)),
                                          flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass
                except zmq.ZMQError:  # the context is being destroyed: the stage is stopping
                    return
        finally:
            socket.close(linger=0)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=2 * self.interval_s + 1)


def busy_for(since: float | None, clock: Callable[[], float] = time.monotonic) -> float:
    """Seconds the current step or load has been running (0 when idle)."""
    return 0.0 if since is None else max(0.0, clock() - since)
