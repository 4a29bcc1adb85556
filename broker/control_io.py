"""The broker's control socket, served on a thread of its own, so the broker is never silent.

Whatever the broker's main loop is doing (preparing a model, planning, waiting on the store, writing
results), this thread keeps the control plane answered: it reads every message as it arrives and stamps
its arrival time, answers a registration at once, sends every stage it has heard from a heartbeat each
interval, tells registered stages what the broker is busy with (`phase`), sends what the main loop asks
it to, and times a stage's link with echoed probes where the round trips are not delayed by the main
loop. The main loop takes the arrivals when it polls (ControlPlane.poll) and judges them as before; a
message's arrival time, not the time it was read, is when the stage was last heard from.

Only this thread touches the ROUTER socket (ZeroMQ sockets belong to one thread): the main loop's sends
travel to it over an inproc PUSH/PULL pair, and it wakes the main loop's poller over an inproc PAIR.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import zmq

from layerbus.wire import protocol
from layerbus.wire.frames import Message, WireError, decode, encode
from layerbus.wire.protocol import HEARTBEAT_IDENTITY_SUFFIX

log = logging.getLogger("layerbus.broker")

MAX_CONTROL_BYTES = 1 << 20  # control messages are headers (and a probe's payload): a MiB at most
FORGET_AFTER_S = 600.0  # a peer not heard from this long gets no more heartbeats
RESET_UNKNOWN_EVERY_S = 5.0  # an unknown stage is told to register at most this often
ECHO_TIMEOUT_S = 10.0  # one echo of a link probe must come back within this
LINK_TIMED = "link_timed"  # the outcome of ControlIO.time_link, as an arrival (never on the wire)
_names = itertools.count()


@dataclass(frozen=True)
class Arrival:
    """One control message as it arrived: who sent it, when, and what it said."""

    identity: bytes  # the stage's control identity (its heartbeat socket's suffix taken off)
    from_heartbeat_thread: bool
    at: float  # the broker's clock when the message arrived
    message: Message | None  # None: it could not be read (`error` says why)
    error: str | None = None
    proven_key: str | None = None  # the CURVE key its handshake proved (secured clusters)

    @property
    def kind(self) -> str | None:
        return self.message.kind if self.message is not None else None


@dataclass
class _LinkTiming:
    """Echo round trips to one stage, alternately without and with a payload (ControlIO.time_link)."""

    token: int
    identity: bytes
    payload_bytes: int
    rounds: int
    seq: int = 0
    sent_at: float = 0.0
    empty: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)


class ControlIO:
    """The thread that serves a bound ROUTER socket (see the module docstring)."""

    def __init__(self, context: zmq.Context, socket: zmq.Socket, clock: Callable[[], float],
                 heartbeat_interval_s: float, heartbeat_fields: Callable[[], dict] = dict,
                 phase: Callable[[], str | None] = lambda: None, secured: bool = False):
        self.context, self.socket, self.clock = context, socket, clock
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_fields = heartbeat_fields  # extra fields of each heartbeat (the tracer's clock stamp)
        self.phase = phase  # what the broker is busy with, said to waiting stages (None: nothing to say)
        self.secured = secured
        name = f"{id(self)}-{next(_names)}"
        self._wake_sender = context.socket(zmq.PAIR)
        self._wake_sender.setsockopt(zmq.LINGER, 0)
        self._wake_sender.bind(f"inproc://layerbus-control-wake-{name}")
        self.wake = context.socket(zmq.PAIR)  # the main loop polls this: readable when arrivals wait
        self.wake.setsockopt(zmq.LINGER, 0)
        self.wake.connect(f"inproc://layerbus-control-wake-{name}")
        self._send_address = f"inproc://layerbus-control-send-{name}"
        self._outbound = context.socket(zmq.PULL)
        self._outbound.setsockopt(zmq.LINGER, 0)
        self._outbound.bind(self._send_address)
        self._senders = threading.local()  # each sending thread's PUSH socket
        self._all_senders: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._arrivals: deque[Arrival] = deque()
        self._commands: deque[tuple] = deque()
        self.peers: dict[bytes, float] = {}  # identity -> when last heard (this thread's)
        self._registered: set[bytes] = set()  # identities that registered with this broker
        self._reset_told: dict[bytes, float] = {}
        self._timings: dict[bytes, _LinkTiming] = {}
        self._tokens = itertools.count(1)
        self._said_phase: str | None = None
        self._next_heartbeat = 0.0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="layerbus-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- the main loop's side ------------------------------------------------------------------
    def send(self, frames: list) -> None:
        """Queue `frames` ([identity, header, tensors...]) for the ROUTER; safe from any thread."""
        sender = getattr(self._senders, "socket", None)
        if sender is None:
            sender = self.context.socket(zmq.PUSH)
            sender.setsockopt(zmq.LINGER, 1000)
            sender.connect(self._send_address)
            self._senders.socket = sender
            with self._lock:
                self._all_senders.append(sender)
        sender.send_multipart(frames, copy=False)

    def take(self) -> list[Arrival]:
        """Every arrival not taken yet, in order; clears the wake-up signals."""
        while self.wake.poll(0):
            self.wake.recv(zmq.NOBLOCK)
        with self._lock:
            taken = list(self._arrivals)
            self._arrivals.clear()
        return taken

    def time_link(self, identity: bytes, payload_bytes: int, rounds: int) -> int:
        """Start timing the link to this stage; the outcome arrives later as a `link_timed` arrival with this
        token: {token, bytes_per_s, latency_s} or {token, error}."""
        token = next(self._tokens)
        with self._lock:
            self._commands.append(("time_link", _LinkTiming(token, identity, payload_bytes, rounds)))
        self._poke()
        return token

    def forget(self, identity: bytes) -> None:
        """No more heartbeats to this stage (sent on to another broker, or gone)."""
        with self._lock:
            self._commands.append(("forget", identity))
        self._poke()

    def close(self, linger_s: float = 0.5) -> None:
        """Send what is queued, then stop the thread and close its sockets."""
        self._stopped.set()
        self._poke()
        self._thread.join(timeout=linger_s + 5.0) if self._thread.is_alive() else None
        with self._lock:
            senders, self._all_senders = self._all_senders, []
        for sender in senders:
            sender.close(linger=0)
        for socket in (self._outbound, self._wake_sender, self.wake):
            socket.close(linger=0)

    def _poke(self) -> None:
        """Wake the thread's poll for a command: an empty message on the outbound pair."""
        self.send([b""])

    # -- this thread -----------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._outbound, zmq.POLLIN)
        try:
            while not self._stopped.is_set():
                wait_ms = max(1, int(1000 * min(0.05, self._next_heartbeat - self.clock())))
                ready = dict(poller.poll(wait_ms))
                if self._outbound in ready:
                    self._forward()
                if self.socket in ready:
                    self._receive()
                self._run_commands()
                self._check_timings()
                self._say_phase()
                if self.clock() >= self._next_heartbeat:
                    self._heartbeat()
            self._forward()  # what the main loop queued before close (a shutdown to every stage)
        except zmq.ZMQError as error:  # the context is being destroyed under us: the broker is closing
            if error.errno != zmq.ETERM:
                log.exception("control thread stopped")
        finally:
            self.socket.close(linger=int(500))

    def _forward(self) -> None:
        while self._outbound.poll(0):
            frames = self._outbound.recv_multipart(copy=False)
            if len(frames) > 1:  # a lone empty frame is a poke
                self.socket.send_multipart(frames, copy=False)

    def _receive(self) -> None:
        arrived = False
        while self.socket.poll(0):
            frames = self.socket.recv_multipart(copy=False)
            arrival = read_arrival(frames, self.clock(), self.secured)
            self.peers[arrival.identity] = arrival.at
            if arrival.kind == protocol.PROBE_ECHO and self._echoed(arrival):
                continue
            if arrival.kind == protocol.REGISTER and not arrival.from_heartbeat_thread:
                self._answer_registration(arrival.identity)
            elif arrival.identity not in self._registered:
                self._tell_to_register(arrival.identity)
            with self._lock:
                self._arrivals.append(arrival)
            arrived = True
        if arrived:
            try:
                self._wake_sender.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the main loop has a wake-up waiting already

    def _send_own(self, identity: bytes, kind: str, **fields) -> None:
        self.socket.send_multipart([identity, *encode(dict(fields, kind=kind))], copy=False)

    def _answer_registration(self, identity: bytes) -> None:
        """A stage that registers hears at once that the broker is there, and what it is busy with."""
        self._registered.add(identity)
        self._reset_told.pop(identity, None)
        phase = self.phase()
        if phase:
            self._send_own(identity, protocol.WAIT, phase=phase, next_s=self.heartbeat_interval_s)
        else:
            self._send_own(identity, protocol.HEARTBEAT, **self.heartbeat_fields())

    def _tell_to_register(self, identity: bytes) -> None:
        """A stage this broker does not know (it registered with a broker before this one, on this
        address) is told to drop whatever it holds and register, at most every few seconds."""
        now = self.clock()
        if now - self._reset_told.get(identity, -RESET_UNKNOWN_EVERY_S) < RESET_UNKNOWN_EVERY_S:
            return
        self._reset_told[identity] = now
        self._send_own(identity, protocol.RESET, why="unknown to this broker")

    def _heartbeat(self) -> None:
        now = self.clock()
        self._next_heartbeat = now + self.heartbeat_interval_s
        fields = self.heartbeat_fields()
        phase = self.phase()
        if phase:
            fields["phase"] = phase
        for identity, heard in list(self.peers.items()):
            if now - heard > FORGET_AFTER_S:
                del self.peers[identity]
                continue
            self._send_own(identity, protocol.HEARTBEAT, **fields)

    def _say_phase(self) -> None:
        """When the broker's phase changes, every stage hears it at once (WAIT), not at the next heartbeat."""
        phase = self.phase()
        if phase == self._said_phase:
            return
        self._said_phase = phase
        if phase:
            for identity in list(self.peers):
                self._send_own(identity, protocol.WAIT, phase=phase, next_s=self.heartbeat_interval_s)

    def _run_commands(self) -> None:
        with self._lock:
            commands, self._commands = list(self._commands), deque()
        for command in commands:
            if command[0] == "forget":
                self.peers.pop(command[1], None)
                self._registered.discard(command[1])
            elif command[0] == "time_link":
                timing = command[1]
                if timing.identity in self._timings:  # one timing per stage at a time: the older one gives way
                    self._timed(self._timings.pop(timing.identity), error="superseded by another timing")
                self._timings[timing.identity] = timing
                self._send_echo(timing)

    # -- link timing: echo round trips measured here, where nothing delays them -------------------
    def _send_echo(self, timing: _LinkTiming) -> None:
        with_payload = timing.seq % 2 == 1
        timing.sent_at = time.perf_counter()
        frames = probe_frames(timing.seq, timing.payload_bytes if with_payload else 0)
        self.socket.send_multipart([timing.identity, *frames], copy=False)

    def _echoed(self, arrival: Arrival) -> bool:
        """An echo of a timing in progress: recorded, the next probe sent; True when it was one."""
        timing = self._timings.get(arrival.identity)
        if timing is None or arrival.message.header.get("seq") != timing.seq:
            return False
        (timing.full if timing.seq % 2 == 1 else timing.empty).append(time.perf_counter() - timing.sent_at)
        timing.seq += 1
        if timing.seq < 2 * timing.rounds:
            self._send_echo(timing)
        else:
            del self._timings[timing.identity]
            small, large = statistics.median(timing.empty), statistics.median(timing.full)
            # Loopback can time a payload no slower than nothing; 1 us keeps the estimate finite and huge.
            self._timed(timing, bytes_per_s=timing.payload_bytes / max(large - small, 1e-6), latency_s=small / 2)
        return True

    def _check_timings(self) -> None:
        for identity, timing in list(self._timings.items()):
            if time.perf_counter() - timing.sent_at > ECHO_TIMEOUT_S:
                del self._timings[identity]
                self._timed(timing, error=f"no echo of probe {timing.seq} within {ECHO_TIMEOUT_S:.0f} s")

    def _timed(self, timing: _LinkTiming, **outcome) -> None:
        header = dict(outcome, token=timing.token, kind=LINK_TIMED)
        with self._lock:
            self._arrivals.append(Arrival(timing.identity, False, self.clock(), Message(header, {})))
        try:
            self._wake_sender.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass


def read_arrival(frames, at: float, secured: bool = False) -> Arrival:
    """A ROUTER message ([identity, header, tensors...]) as an Arrival: decoded, or with why it is unreadable."""
    identity = bytes(frames[0].buffer) if hasattr(frames[0], "buffer") else bytes(frames[0])
    from_heartbeat_thread = identity.endswith(HEARTBEAT_IDENTITY_SUFFIX)
    if from_heartbeat_thread:
        identity = identity[:-len(HEARTBEAT_IDENTITY_SUFFIX)]
    key = _proven_key(frames[1]) if secured and len(frames) > 1 else None
    try:
        message = decode(frames[1:], MAX_CONTROL_BYTES)
    except WireError as error:
        return Arrival(identity, from_heartbeat_thread, at, None, str(error), key)
    return Arrival(identity, from_heartbeat_thread, at, message, None, key)


def _proven_key(frame) -> str | None:
    """The CURVE key (Z85) the sender's handshake proved: the ZAP User-Id of a message's frame."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None


def probe_frames(seq: int, payload_bytes: int) -> list:
    """A link probe's frames: its sequence number, and `payload_bytes` of zeros to carry (0: none)."""
    import torch

    payload = {"payload": torch.zeros(payload_bytes, dtype=torch.uint8)} if payload_bytes else None
    return encode({"kind": protocol.PROBE, "seq": seq}, payload)
