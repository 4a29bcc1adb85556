"""The front door of `layerbus broker --stages N --chains K`: one address for every stage, K chains behind it.

It binds the control address the stages are given (`layerbus stage --broker ADDRESS`) and runs no model.
It answers each stage's registration with a redirect (wire/protocol.py) to its chain's broker, a
`layerbus broker` process of its own bound on two ports of its own (launch/broker_chains.py), where the
stage registers again and is placed as with any broker. The chains then work the store's jobs side by
side through the item leases, as several brokers on one job always can (jobs/leases.py).

A stage keeps its chain: one that restarts and registers here again (run_cluster.sh and the systemd
units restart stages under their names) is sent back to the chain it was in, which is waiting for it.

A stage is sent on only once its chain's broker listens (`mark_ready`): a broker process takes seconds to
start, and a stage that registered with nobody would give up after its --broker-timeout. Until then the
front door answers the stage's heartbeats with its own, so the stage knows someone is there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import AbstractSet, Sequence

import zmq

from layerbus.wire import protocol
from layerbus.wire.curve import ClusterKeys, CurveGate
from layerbus.wire.frames import WireError, decode, encode

log = logging.getLogger("layerbus.front_door")


def chain_for_stage(name: str, assigned: dict[str, int], sizes: Sequence[int], ended: AbstractSet[int] = frozenset()) -> int:
    """The chain (an index into `sizes`, each chain's stage count) a registering stage joins: the one it
    joined before, for a restarted stage, unless that chain has ended for good (`ended`: its broker exited
    and is not started again; the stage is then a survivor its chain gave back); else the first chain still
    short of its size; else (a stage beyond N: a spare, which its chain's broker takes up when one of its
    stages is lost or, mid-job, when the stage would speed the chain up) the chain with the fewest stages
    for its size, the first of equals. Ended chains are chosen only when every chain has ended."""
    if name in assigned and assigned[name] not in ended:
        return assigned[name]
    open_chains = [chain for chain in range(len(sizes)) if chain not in ended] or list(range(len(sizes)))
    counts = [0] * len(sizes)
    for stage, chain in assigned.items():
        if stage != name:
            counts[chain] += 1
    for chain in open_chains:
        if counts[chain] < sizes[chain]:
            return chain
    return min(open_chains, key=lambda chain: (counts[chain] / sizes[chain], chain))


@dataclass(frozen=True)
class ChainDoor:
    """One chain behind the front door: where its broker listens for its stages, and how many it places."""

    label: str  # "chain 2"
    control_bind: str  # its broker's --bind-control, e.g. tcp://0.0.0.0:5557
    size: int


@dataclass
class FrontDoor:
    """`serve(timeout_ms)` answers the registrations that arrived; `assigned` says which stage went where."""

    context: zmq.Context
    bind: str
    chains: Sequence[ChainDoor]
    keys: ClusterKeys | None = None
    assigned: dict[str, int] = field(default_factory=dict)  # stage name -> chain index
    # Stages waiting for their chain's broker to listen: control identity -> (name, host, chain index).
    waiting: dict[bytes, tuple[str, str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ready = [False] * len(self.chains)
        self.ended: set[int] = set()  # chains whose broker exited for good: their stages go to the others
        # The same CURVE server as a broker's control plane (broker/control.py): the stages hold its key.
        self.gate = CurveGate(self.context, self.keys.keypair, self.keys.allowed) if self.keys is not None else None
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted stage reuses its name
        if self.gate is not None:
            self.gate.guard(self.socket)
        try:
            self.socket.bind(self.bind)
        except zmq.ZMQError:
            self.close()  # an open socket would hold its context's term() for ever
            raise
        self.address = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def serve(self, timeout_ms: int) -> list[str]:
        """Redirect every stage that registered within `timeout_ms`; a line for each, saying where it went."""
        moved = []
        if self.socket.poll(timeout_ms):
            while self.socket.poll(0):
                line = self._answer(self.socket.recv_multipart(copy=False))
                if line is not None:
                    moved.append(line)
        if self.gate is not None:
            for refusal in self.gate.refusals():
                log.warning("front door %s: %s", self.address, refusal.describe())
        return moved

    def _answer(self, frames) -> str | None:
        identity = bytes(frames[0].buffer)
        try:
            message = decode(frames[1:], 1 << 20)
        except WireError as error:
            log.warning("front door: a malformed message from %r: %s", identity, error)
            return None
        if message.kind == protocol.HEARTBEAT and identity.endswith(protocol.HEARTBEAT_IDENTITY_SUFFIX):
            control = identity[:-len(protocol.HEARTBEAT_IDENTITY_SUFFIX)]
            if control in self.waiting:
                self._send(control, protocol.HEARTBEAT)
            return None
        if message.kind != protocol.REGISTER:
            return None  # a bye, or a late message from a stage already sent on
        name = str(message.header.get("name") or identity.decode(errors="replace"))
        # A stage whose chain gave up comes back before the chain's process is seen to end: never back to it.
        # (If every chain has ended it waits here; the front door is about to exit.)
        given_up = {self.assigned[name]} if message.header.get("left_chain") is True and name in self.assigned else set()
        chain = self._chain_for(name, self.ended | given_up)
        self.assigned[name] = chain
        self.waiting[identity] = (name, str(message.header.get("host", "?")), chain)
        if self.ready[chain] and chain not in given_up:
            return self._send_on(identity)
        self._send(identity, protocol.HEARTBEAT)
        return None

    def mark_ready(self, chain: int) -> list[str]:
        """Chain `chain`'s broker listens: send on the stages that wait for it; a line for each."""
        self.ready[chain] = True
        return [self._send_on(identity) for identity, (_, _, waits_for) in list(self.waiting.items())
                if waits_for == chain]

    def mark_gone(self, chain: int) -> None:
        """Chain `chain`'s broker ended: its stages that register again wait here until it listens again."""
        self.ready[chain] = False

    def mark_ended(self, chain: int) -> list[str]:
        """Chain `chain`'s broker ended for good (it is not started again): its stages that come back here (a
        chain that gives up sends its survivors back) go to the chains still working; so do those already
        waiting for it. A line for each sent on now."""
        self.ready[chain] = False
        self.ended.add(chain)
        moved = []
        for identity, (name, host, waits_for) in list(self.waiting.items()):
            if waits_for == chain:
                other = self._chain_for(name, self.ended)
                self.assigned[name] = other
                self.waiting[identity] = (name, host, other)
                if self.ready[other]:
                    moved.append(self._send_on(identity))
        return moved

    def _chain_for(self, name: str, ended: AbstractSet[int]) -> int:
        return chain_for_stage(name, self.assigned, [door.size for door in self.chains], ended)

    def _send_on(self, identity: bytes) -> str:
        name, host, chain = self.waiting.pop(identity)
        door = self.chains[chain]
        self._send(identity, protocol.REDIRECT, **protocol.redirect_header(door.control_bind))
        return f"stage {name} (host {host}) -> {door.label} at {door.control_bind}"

    def _send(self, identity: bytes, kind: str, **fields) -> None:
        self.socket.send_multipart([identity, *encode(dict(fields, kind=kind))], copy=False)

    def close(self) -> None:
        """Stages still waiting here (their chain ended, and no other runs) are told to stop, as a broker's are."""
        for identity in self.waiting:
            self._send(identity, protocol.SHUTDOWN)
        if self.gate is not None:
            self.gate.close()
        self.socket.close(linger=500 if self.waiting else 0)  # time for those shutdowns to leave
