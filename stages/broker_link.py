"""A stage's link to its broker: the control socket, the heartbeats, the registration, and when the broker
counts as gone.

A stage may start long before its broker can answer (a broker preparing a model, a node that boots later,
Slurm or systemd starting tasks in no fixed order). Until the broker first answers, the stage waits for
it: it registers whenever a connection is made, sends its registration again (with back-off) while no
answer comes, says every ~10 s whom it waits for, and gives up only after `--wait-for-broker` (no limit
by default). Once the broker has spoken, `--broker-timeout` counts from its last message. A broker that
is busy says so (WAIT: "preparing the model", "planning"), and the stage says it once in its log. A stage
that outlives its broker registers with the next one on the same address: on the new connection, and when
that broker tells it it does not know it (RESET).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from layerbus.stages.heartbeat import HeartbeatThread
from layerbus.wire import protocol
from layerbus.wire.curve import StageKeys, handshake_events, secure_client, watch_handshakes
from layerbus.wire.frames import Message, WireError, decode, encode

log = logging.getLogger("layerbus.stage")

REGISTER_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 10.0)  # waits between registrations while the broker has not answered
WAITING_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class LinkConfig:
    """How a stage keeps to its broker."""

    broker: str  # the broker's control endpoint
    heartbeat_interval_s: float = 0.5
    broker_timeout_s: float = 15.0  # once the broker has spoken: exit when it is silent this long
    wait_for_broker_s: float | None = None  # before it has: exit after waiting this long (None: no limit)
    keys: StageKeys | None = None  # CURVE: this stage's keypair and the broker's public key


@dataclass(frozen=True)
class Gone:
    """Why the link is over: an exit code and the message that says it."""

    code: int
    why: str


class BrokerLink:
    def __init__(self, context: zmq.Context, config: LinkConfig, name: str, heartbeat_fields: Callable[[], dict],
                 clock: Callable[[], float] = time.monotonic):
        self.context, self.config, self.name, self.clock = context, config, name, clock
        self.heartbeat_fields = heartbeat_fields  # read on the heartbeat thread, from the main loop's state
        self.registration: dict = {}  # the REGISTER fields (name, device, data address, ...), set before connect
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, name.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self._secure(self.socket)
        self.handshakes = watch_handshakes(self.socket)  # connections made, and handshakes the broker refused
        self.heartbeats: HeartbeatThread | None = None
        self.admitted = False  # the broker has answered since this stage started (or moved)
        self.connected = False
        self.last_heard = clock()
        self.waiting_since = clock()
        self.failed_handshake: str | None = None  # why the last handshake failed before the broker answered
        self.left_chain = False  # said once in the next registration (a chain that gave up sent it back)
        self._registrations = 0
        self._next_registration = float("inf")
        self._next_waiting_log = clock() + WAITING_LOG_EVERY_S
        self._phase: str | None = None

    # -- the connection --------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect and start the heartbeats; the registration goes once the connection is made."""
        self.socket.connect(self.config.broker)
        self._start_heartbeats()

    def move_to(self, endpoint: str) -> None:
        """Another broker takes this stage (a front door's redirect): link to it; the registration goes once
        the connection is made (a redirect to where it already is changes nothing)."""
        if endpoint == self.config.broker:
            return
        self.socket.disconnect(self.config.broker)
        self.config = LinkConfig(endpoint, self.config.heartbeat_interval_s, self.config.broker_timeout_s,
                                 self.config.wait_for_broker_s, self.config.keys)
        self.admitted, self.waiting_since, self.last_heard = False, self.clock(), self.clock()
        self.socket.connect(endpoint)
        self._registrations = 0
        if self.heartbeats is not None:
            self.heartbeats.stop()
        self._start_heartbeats()

    def _start_heartbeats(self) -> None:
        self.heartbeats = HeartbeatThread(self.context, self.config.broker, self.name.encode(),
                                          self.config.heartbeat_interval_s, self.heartbeat_fields, self._secure)
        self.heartbeats.start()

    def _secure(self, socket: zmq.Socket) -> None:
        """A control socket (this one or the heartbeat thread's) as a CURVE client of the broker."""
        if self.config.keys is not None:
            secure_client(socket, self.config.keys.keypair, self.config.keys.broker)

    def register(self) -> None:
        """Say who this stage is; again later, with back-off, while the broker has not answered."""
        extra = {"left_chain": True} if self.left_chain else {}
        self.left_chain = False
        self.send(protocol.REGISTER, **self.registration, **extra)
        self._registrations += 1
        step = REGISTER_BACKOFF_S[min(self._registrations - 1, len(REGISTER_BACKOFF_S) - 1)]
        self._next_registration = self.clock() + step
        if self._registrations == 1 or self.admitted:
            log.info("stage %s registered with %s, receiving on %s", self.name, self.config.broker,
                     self.registration.get("data_address"))

    def send(self, kind: str, **fields) -> None:
        self.socket.send_multipart(encode(dict(fields, kind=kind)), copy=False)

    # -- what comes from the broker --------------------------------------------------------------
    def receive(self) -> list[Message]:
        """Every message the broker sent that is waiting, decoded; the broker counts as heard from. A WAIT is
        said in the log when what the broker is busy with changes, and handled here."""
        messages = []
        while self.socket.poll(0):
            frames = self.socket.recv_multipart(copy=False)
            self.last_heard = self.clock()
            if not self.admitted:
                self.admitted, self._next_registration = True, float("inf")
                log.info("stage %s: the broker at %s answered (after %.1f s)", self.name, self.config.broker,
                         self.last_heard - self.waiting_since)
            try:
                message = decode(frames, 1 << 20)
            except WireError as error:
                log.error("stage %s: malformed control message from the broker: %s", self.name, error)
                continue
            phase = message.header.get("phase") if message.kind in (protocol.WAIT, protocol.HEARTBEAT) else None
            if message.kind == protocol.WAIT or phase is not None or (message.kind == protocol.HEARTBEAT and self._phase):
                self._note_phase(phase if isinstance(phase, str) else None, message.header.get("next_s"))
            if message.kind != protocol.WAIT:
                messages.append(message)
        return messages

    def _note_phase(self, phase: str | None, next_s: object) -> None:
        if phase == self._phase:
            return
        self._phase = phase
        if phase:
            more = f"; it speaks again within {next_s:g} s" if isinstance(next_s, (int, float)) else ""
            log.info("stage %s: the broker is busy: %s%s", self.name, phase, more)

    # -- judging the link ------------------------------------------------------------------------
    def check(self) -> Gone | None:
        """Look at the handshakes, register where a connection was made (or again, while unanswered), and
        judge the silence; a Gone once this stage should stop, else None."""
        gone = self._watch_handshakes()
        if gone is not None:
            return gone
        now = self.clock()
        if not self.admitted:
            return self._waiting(now)
        silent = now - self.last_heard
        if silent > self.config.broker_timeout_s and self.socket.poll(0):
            return None  # a long step kept the broker's messages waiting: they were on time (receive them)
        if silent > self.config.broker_timeout_s:
            return Gone(3, f"broker {self.config.broker} silent for {silent:.1f} s; exiting")
        return None

    def _watch_handshakes(self) -> Gone | None:
        if not self.handshakes.poll(0):
            return None
        seen = handshake_events(self.handshakes)
        if seen.connected is not None:
            self.connected = seen.connected
        if seen.succeeded:  # a connection made (first, or after the broker restarted): say who this stage is
            self.register()
        if seen.failure is None:
            return None
        why, for_good = seen.failure
        if not self.admitted:
            self.failed_handshake = why
        (log.error if for_good else log.warning)(
            "stage %s: no link to the broker at %s: %s; a secured broker needs this stage's --keys (its NAME.key "
            "copied into the broker's --allow folder) and --broker-key (the broker's NAME.key)",
            self.name, self.config.broker, why)
        return Gone(2, why) if for_good else None

    def _waiting(self, now: float) -> Gone | None:
        """Before the broker's first answer: register again when due, say whom it waits for, give up only
        after --wait-for-broker."""
        waited = now - self.waiting_since
        limit = self.config.wait_for_broker_s
        if self.failed_handshake is not None and waited > self.config.broker_timeout_s:
            # Never admitted and libzmq's retries keep failing (a keyless stage may see only broken pipes from a
            # secured broker, never the telling "mechanism mismatch"): no link at all.
            return Gone(2, f"no link to the broker at {self.config.broker} after {waited:.1f} s: "
                           f"{self.failed_handshake}; a secured broker needs this stage's --keys and --broker-key")
        if limit is not None and waited > limit:
            return Gone(3, f"no answer from the broker at {self.config.broker} within --wait-for-broker "
                           f"{limit:g} s; exiting")
        if self.connected and now >= self._next_registration:
            self.register()
        if now >= self._next_waiting_log:
            self._next_waiting_log = now + WAITING_LOG_EVERY_S
            state = "connected, no answer yet" if self.connected else "no connection yet"
            bound = "no limit" if limit is None else f"up to {limit:g} s"
            log.info("stage %s: waiting for the broker at %s (%s; %.0f s so far, --wait-for-broker %s)", self.name,
                     self.config.broker, state, waited, bound)
        return None

    def close(self, stats: dict) -> None:
        """Stop the heartbeats and say goodbye (without waiting: the broker may be gone)."""
        if self.heartbeats is not None:
            self.heartbeats.stop()
        try:
            self.socket.send_multipart(encode({"kind": protocol.BYE, "stats": stats}), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
