"""A stage's side of the measured link matrix: it answers other stages' link probes that
arrive on its data port, and, when the broker asks (`link_probe`), times its own link to each peer
stage: echo round trips and bursts of step-sized messages, with wire/link_probe.py's functions (the
ones `layerbus netprobe` uses), sent to the peer's data address as steps travel.

Probes are told from steps by their header's kind (wire/link_probe.py's netprobe_* kinds); the broker
sends them only while no pipeline runs (at registration, or during a re-plan), and a probe is never
counted as a step, as busy time or as received bytes. On a secured cluster the probe's PUSH is a CURVE
client of the peer's key, the answers' PULL a CURVE server of this stage's keypair, and the peer's
answers a client of the key the probe's own handshake proved (ZAP's User-Id).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from layerbus.wire import link_probe, protocol
from layerbus.wire.frames import WireError
from layerbus.wire.link_cost import round_trips

PROBE_KINDS = frozenset({link_probe.ECHO, link_probe.DATA, link_probe.BYE})
_PROBE_MARK = b'"kind":"netprobe_'  # a cheap test before parsing: step headers never hold it
Secure = Callable[[zmq.Socket, bytes], None]  # make a socket a CURVE client of this server key (Z85)


def is_link_probe(frames: list[Any]) -> bool:
    """True when a message on the data port is a link probe, not a step."""
    if not frames:
        return False
    raw = frames[0].bytes if isinstance(frames[0], zmq.Frame) else bytes(frames[0])
    if _PROBE_MARK not in raw:
        return False
    try:
        header = json.loads(raw)
    except ValueError:
        return False
    return isinstance(header, dict) and header.get("kind") in PROBE_KINDS


def proven_key(frame: Any) -> bytes | None:
    """The CURVE key (Z85) the sender's handshake proved, from a received frame; None unsecured."""
    try:
        key = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    return key.encode() if isinstance(key, str) and len(key) == 40 else None


@dataclass(frozen=True)
class Peer:
    """One stage to probe: its name, its data address and (secured) its CURVE key."""

    name: str
    address: str
    key: str | None = None


@dataclass(frozen=True)
class PeerProbeRequest:
    """What the broker's `link_probe` message asks for."""

    peers: tuple[Peer, ...]
    step_bytes: int  # one step's hidden states, as the chain would send them
    rows: int  # sequences in that step
    echoes: int  # round trips timed per peer (the median counts)
    burst_s: float  # each bandwidth figure comes from a burst at least this long
    connect_timeout_s: float  # the first answer of a peer: its connection and handshake

    @classmethod
    def from_header(cls, header: dict) -> "PeerProbeRequest":
        protocol.require_fields(header, "link_probe", {"peers": list, "step_bytes": int, "rows": int, "echoes": int})
        for name in ("burst_s", "connect_timeout_s"):
            if isinstance(header.get(name), bool) or not isinstance(header.get(name), (int, float)):
                raise WireError(f"link_probe header field {name!r} must be a number of seconds, "
                                f"got {header.get(name)!r:.60}")
        peers = []
        for entry in header["peers"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise WireError(f"link_probe: each peer must be {{name, address, key?}}, got {entry!r:.80}")
            if not isinstance(entry.get("address"), str):
                raise WireError(f"link_probe peer {entry['name']}: address must be a string, got {entry.get('address')!r:.60}")
            address = protocol.require_endpoint(entry["address"], f"link_probe peer {entry['name']}")
            key = entry.get("key")
            if key is not None and (not isinstance(key, str) or len(key) != 40):
                raise WireError(f"link_probe peer {entry['name']}: key must be a 40-character Z85 CURVE key")
            peers.append(Peer(entry["name"], address, key))
        request = cls(tuple(peers), header["step_bytes"], header["rows"], header["echoes"],
                      float(header["burst_s"]), float(header["connect_timeout_s"]))
        if request.step_bytes < 1 or request.rows < 1 or request.echoes < 1 or not (
                0 < request.burst_s <= 60 and 0 < request.connect_timeout_s <= 300):
            raise WireError(f"link_probe: need step_bytes, rows, echoes >= 1, 0 < burst_s <= 60 and "
                            f"0 < connect_timeout_s <= 300, got {header!r:.200}")
        return request


class PeerProber:
    """Times this stage's links to its peers: one answers' PULL per request, bound on the interface the
    data port is bound on and advertised at the data address's host (peers must reach it, as they
    reach the data port), one PUSH per peer."""

    def __init__(self, context: zmq.Context, bound: str, advertised: str,
                 secure_client: Secure | None = None, secure_server: Callable[[zmq.Socket], None] | None = None):
        self.context = context
        self.bound, self.advertised = bound, advertised  # the data port's endpoints: as bound, as others reach it
        self.secure_client, self.secure_server = secure_client, secure_server
        self.next_number = 0  # echo and burst numbers, never reused: a late answer is never taken for a new one

    def probe(self, request: PeerProbeRequest) -> list[dict]:
        """One entry per peer: {peer, round_trip_s, bytes_per_s, bursts} or {peer, error}."""
        inp = self.context.socket(zmq.PULL)
        inp.setsockopt(zmq.LINGER, 0)
        if self.secure_server is not None:
            self.secure_server(inp)
        try:
            reply = self._bind_reply(inp)
        except (ValueError, zmq.ZMQError) as error:
            inp.close(linger=0)
            return [{"peer": peer.name, "error": f"no address for the answers: {error}"} for peer in request.peers]
        try:
            return [self._probe_peer(inp, reply, peer, request) for peer in request.peers]
        finally:
            inp.close(linger=0)

    def _bind_reply(self, inp: zmq.Socket) -> str:
        bound_host, advertised_host = _tcp_host(self.bound), _tcp_host(self.advertised)
        port = inp.bind_to_random_port(f"tcp://{bound_host}")
        return f"tcp://{advertised_host}:{port}"

    def _probe_peer(self, inp: zmq.Socket, reply: str, peer: Peer, request: PeerProbeRequest) -> dict:
        out = self.context.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        try:
            if peer.key is not None and self.secure_client is not None:
                self.secure_client(out, peer.key.encode())
            out.connect(peer.address)
            # The first echo opens the connection (and its handshake); it is not counted.
            link_probe.measure_round_trips(out, inp, reply, 1, timeout_s=request.connect_timeout_s,
                                           first_seq=self._numbers(1))
            samples = link_probe.measure_round_trips(out, inp, reply, request.echoes,
                                                     timeout_s=request.connect_timeout_s,
                                                     first_seq=self._numbers(request.echoes))
            trips = round_trips(samples)
            parts = link_probe.step_parts({"": request.step_bytes})
            sample = link_probe.measure_bandwidth(out, inp, reply, parts, request.rows, trips.median_s,
                                                  target_s=request.burst_s, max_bytes=1 << 30,
                                                  first_burst=self._numbers(64))
            link_probe.say_goodbye(out, reply)
            if not (math.isfinite(sample.bytes_per_s) and sample.bytes_per_s > 0):
                return {"peer": peer.name, "error": f"bandwidth came out as {sample.bytes_per_s}"}
            return {"peer": peer.name, "round_trip_s": trips.median_s, "bytes_per_s": sample.bytes_per_s,
                    "bursts": sample.bursts, "burst_s": sample.burst.seconds}
        except (link_probe.ProbeError, zmq.ZMQError) as error:
            return {"peer": peer.name, "error": f"{type(error).__name__}: {error}"}
        finally:
            out.close(linger=200)  # long enough for the goodbye, which closes the peer's answer socket

    def _numbers(self, count: int) -> int:
        """The first of `count` fresh sequence numbers."""
        first, self.next_number = self.next_number, self.next_number + count
        return first


def _tcp_host(endpoint: str) -> str:
    """The host part of tcp://HOST:PORT; ValueError for other transports (a probe needs a routed address)."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(f"link probes need a tcp:// data address, this stage has {endpoint!r}")
    return endpoint[6:].rsplit(":", 1)[0]
