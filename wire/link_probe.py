"""Timing a link over ZeroMQ: echo round trips and bandwidth bursts at one step's message size.

Messages are framed as the data plane frames a step (wire/frames.py: one JSON header frame with
`v`, `kind` and the tensor specs, then one raw frame per tensor part, sent with copy=False), and
travel over the data plane's socket types: the peer binds a PULL (as a stage's data port), the
prober connects a PUSH to it and binds a PULL of its own for the answers (as the broker's results
socket). Every header names that answer address (`reply`) and the peer connects a PUSH back to it,
so answers need the peer to reach the prober, as a chain's last stage must reach the broker.

Sockets and the clock are passed in: `layerbus netprobe` uses these functions between two
machines, and the same ones can time the links between stages. No torch here: the tensor frames
are plain bytes of the sizes wire/codec_sizes.py gives.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from layerbus.wire.link_cost import bandwidth, next_burst

log = logging.getLogger("layerbus.netprobe")

WIRE_VERSION = 1  # as wire.frames.WIRE_VERSION: a probe message passes the data plane's own decoder
ECHO, DATA, RECEIVED, BYE = "netprobe_echo", "netprobe_data", "netprobe_received", "netprobe_bye"
MAX_HEADER_BYTES = 1 << 20  # as wire.frames: a header beyond this is refused unread
_REPLY_ADDRESS = re.compile(r"(tcp|ipc|inproc)://[^\s]{1,200}")
Clock = Callable[[], float]


class ProbeError(RuntimeError):
    """The peer did not answer, or answered something else than what was sent."""


# -- messages ---------------------------------------------------------------------------------------

def header_frame(kind: str, parts: dict[str, int] | None = None, **fields: Any) -> bytes:
    """A header as wire.frames.encode writes it; `parts` (name -> bytes) become uint8 tensor specs."""
    specs = [{"name": name, "dtype": "uint8", "shape": [size]} for name, size in (parts or {}).items()]
    return json.dumps(dict(fields, kind=kind, v=WIRE_VERSION, tensors=specs), separators=(",", ":")).encode()


def step_parts(codec_parts: dict[str, int]) -> dict[str, int]:
    """Tensor names as a step names its hidden states: "hidden", "hidden.q", "hidden.scale", ..."""
    return {f"hidden.{part}" if part else "hidden": size for part, size in codec_parts.items()}


def step_frames(parts: dict[str, int], rows: int, payload: memoryview, burst: int, last: bool,
                reply: str) -> list[Any]:
    """One bandwidth message the size of a decode step of `rows` sequences: a step-like header (its
    rows, as the broker writes them) and one frame per part, sliced from `payload` (not copied)."""
    header = header_frame(DATA, parts, burst=burst, last=last, reply=reply,
                          rows=[[slot, 0, 1, 1, {}] for slot in range(rows)])
    return [header, *(payload[:size] for size in parts.values())]


def parse_header(frames: list[Any]) -> dict[str, Any]:
    """The header of a received message, checked as far as a probe relies on it; ValueError if not."""
    if not frames:
        raise ValueError("empty message")
    raw = frames[0].bytes if isinstance(frames[0], zmq.Frame) else bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    header = json.loads(raw)
    if not isinstance(header, dict) or header.get("v") != WIRE_VERSION or not isinstance(header.get("kind"), str):
        raise ValueError(f"not a version-{WIRE_VERSION} message with a kind: {raw[:80]!r}")
    specs = header.get("tensors", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ValueError(f"header announces {specs!r:.60} but {len(frames) - 1} tensor frame(s) arrived")
    for spec, frame in zip(specs, frames[1:]):
        if not isinstance(spec, dict) or spec.get("shape") != [len(frame)] or spec.get("dtype") != "uint8":
            raise ValueError(f"tensor spec {spec!r:.60} does not match a frame of {len(frame)} bytes")
    return header


# -- the prober's side ------------------------------------------------------------------------------

def _send(socket: zmq.Socket, frames: list[Any], timeout_s: float) -> None:
    try:
        socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:  # the high-water mark is reached: wait for room, as long as the peer may take
        if not socket.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise ProbeError(f"could not send for {timeout_s:.0f} s: the peer stopped reading") from None
        socket.send_multipart(frames, copy=False)


def _await(inp: zmq.Socket, kind: str, accept: Callable[[dict], bool], deadline: float, clock: Clock) -> dict:
    """The first answer of `kind` that `accept`s; stale answers (an echo that came late) are skipped."""
    while True:
        left = deadline - clock()
        if left <= 0 or not inp.poll(max(1, int(left * 1000))):
            raise ProbeError(f"no {kind} answer in time")
        frames = inp.recv_multipart(copy=False)
        try:
            header = parse_header(frames)
        except ValueError as error:
            log.warning("malformed answer ignored: %s", error)
            continue
        if header["kind"] == kind and accept(header):
            return header


def measure_round_trips(out: zmq.Socket, inp: zmq.Socket, reply: str, count: int,
                        clock: Clock = time.perf_counter, timeout_s: float = 5.0, first_seq: int = 0) -> list[float]:
    """Seconds of `count` echo round trips of a header-only message, one after another. `first_seq`
    numbers the echoes, so a late answer to an earlier call is never taken for one of these."""
    samples = []
    for seq in range(first_seq, first_seq + count):
        started = clock()
        _send(out, [header_frame(ECHO, seq=seq, reply=reply)], timeout_s)
        _await(inp, ECHO, lambda header, seq=seq: header.get("seq") == seq, started + timeout_s, clock)
        samples.append(clock() - started)
    return samples


@dataclass(frozen=True)
class Burst:
    """One timed burst of step-sized messages: what was sent, and from first send to acknowledgement."""

    messages: int
    step_bytes: int  # one message: header and tensor frames
    bytes_sent: int
    seconds: float


def send_burst(out: zmq.Socket, inp: zmq.Socket, reply: str, parts: dict[str, int], rows: int, messages: int,
               burst: int, clock: Clock = time.perf_counter, timeout_s: float = 30.0) -> Burst:
    """Send `messages` step messages back to back and wait for the peer to count them all; ProbeError
    when its count differs (a message lost or mangled on the way)."""
    payload = memoryview(bytearray(max(parts.values(), default=0)))
    frames = step_frames(parts, rows, payload, burst, False, reply)
    final = step_frames(parts, rows, payload, burst, True, reply)
    step_bytes = sum(len(frame) for frame in frames)
    sent = step_bytes * (messages - 1) + sum(len(frame) for frame in final)
    started = clock()
    for _ in range(messages - 1):
        _send(out, frames, timeout_s)
    _send(out, final, timeout_s)
    answer = _await(inp, RECEIVED, lambda header: header.get("burst") == burst, started + timeout_s, clock)
    elapsed = clock() - started
    if (answer.get("messages"), answer.get("bytes")) != (messages, sent):
        raise ProbeError(f"the peer counted {answer.get('messages')} message(s) of {answer.get('bytes')} bytes, "
                         f"{messages} of {sent} were sent")
    return Burst(messages, step_bytes, sent, elapsed)


@dataclass(frozen=True)
class BandwidthSample:
    """The burst that set the figure, and the figure."""

    burst: Burst
    bytes_per_s: float
    bursts: int  # bursts sent to get there (each longer than the one before)


def measure_bandwidth(out: zmq.Socket, inp: zmq.Socket, reply: str, parts: dict[str, int], rows: int,
                      round_trip_s: float, target_s: float = 0.5, max_bytes: int = 4 << 30,
                      clock: Clock = time.perf_counter, first_burst: int = 0) -> BandwidthSample:
    """Bytes/s for step messages of these parts: bursts that grow until one lasts `target_s` (or
    would exceed `max_bytes`); that last burst's figure, the round trip taken off (link_cost.bandwidth).
    `first_burst` numbers the bursts, so answers to an earlier call are never taken for these."""
    messages, number = 1, first_burst
    while True:
        burst = send_burst(out, inp, reply, parts, rows, messages, number, clock, timeout_s=max(30.0, 4 * target_s))
        number += 1
        grown = next_burst(messages, burst.seconds, target_s)
        if burst.seconds >= target_s or grown * burst.step_bytes > max_bytes:
            rate = bandwidth(burst.bytes_sent, burst.seconds, round_trip_s)
            return BandwidthSample(burst, rate, number - first_burst)
        messages = grown


def say_goodbye(out: zmq.Socket, reply: str) -> None:
    """Let the peer close its socket back to us (best effort: a peer gone already needs nothing)."""
    try:
        out.send_multipart([header_frame(BYE, reply=reply)], flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


# -- the peer's side --------------------------------------------------------------------------------

class EchoPeer:
    """Answers probes arriving on a PULL socket: echoes at once, counts bursts, acknowledges their
    last message. Reply sockets are opened on first use per answer address, at most `max_peers`."""

    def __init__(self, context: zmq.Context, max_peers: int = 32,
                 secure_reply: Callable[[zmq.Socket, Any], None] | None = None):
        self.context = context
        self.max_peers = max_peers
        # Secured (a stage's data port): makes an answer socket, before it connects, a CURVE client of the
        # prober, given the probe's first frame (whose handshake proved the prober's key).
        self.secure_reply = secure_reply
        self.replies: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.counts: dict[str, tuple[int, int, int]] = {}  # reply -> (burst, messages, bytes) of its current burst

    def handle(self, frames: list[Any]) -> None:
        try:
            header = parse_header(frames)
            reply = header.get("reply")
            if not isinstance(reply, str) or not _REPLY_ADDRESS.fullmatch(reply):
                raise ValueError(f"answer address must be tcp://, ipc:// or inproc://, got {reply!r:.80}")
        except ValueError as error:
            log.warning("malformed probe ignored: %s", error)
            return
        kind = header["kind"]
        if kind == ECHO:
            self._answer(reply, header_frame(ECHO, seq=header.get("seq")), frames[0])
        elif kind == DATA:
            burst, messages, received = self.counts.get(reply, (None, 0, 0))
            if header.get("burst") != burst:
                burst, messages, received = header.get("burst"), 0, 0
            messages, received = messages + 1, received + sum(len(frame) for frame in frames)
            self.counts[reply] = (burst, messages, received)
            if header.get("last") is True:
                self._answer(reply, header_frame(RECEIVED, burst=burst, messages=messages, bytes=received), frames[0])
                del self.counts[reply]
        elif kind == BYE:
            self.counts.pop(reply, None)
            socket = self.replies.pop(reply, None)
            if socket is not None:
                socket.close(linger=1000)
        else:
            log.warning("probe of unknown kind %r ignored", kind)

    def _answer(self, reply: str, header: bytes, probe_frame: Any = None) -> None:
        socket = self.replies.get(reply)
        if socket is None:
            if len(self.replies) >= self.max_peers:  # a prober that left without a goodbye
                _, oldest = self.replies.popitem(last=False)
                oldest.close(linger=0)
            socket = self.replies[reply] = self.context.socket(zmq.PUSH)
            if self.secure_reply is not None:
                self.secure_reply(socket, probe_frame)
            socket.connect(reply)
        self.replies.move_to_end(reply)
        try:
            socket.send(header, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("answer to %s dropped: it is not reading", reply)

    def close(self) -> None:
        for socket in self.replies.values():
            socket.close(linger=0)
        self.replies.clear()


def serve(inp: zmq.Socket, peer: EchoPeer, stop: Callable[[], bool] = lambda: False, poll_ms: int = 200) -> None:
    """Answer probes arriving on `inp` until `stop()` says so (checked every `poll_ms`)."""
    while not stop():
        if inp.poll(poll_ms):
            peer.handle(inp.recv_multipart(copy=False))
