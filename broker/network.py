"""Where each stage runs and what the link between any two of them costs: the planner's view of the
network, as plain values. Built from a cluster file's hosts, `[[links]]` and `[network]` table
(broker.cluster_file), and meant to be filled from measured probes the same way; the placement
planner reads it (broker.placement) to price each stage's send by the link to its actual successor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

BROKER = "broker"  # the broker's name in a matrix: it sends the first stage token ids, the last sends them back


@dataclass(frozen=True)
class Link:
    """One direction of one link, as a pipeline step sees it."""

    bandwidth: float = math.inf  # bytes/s (inf: sending costs no time)
    latency_s: float = 0.0  # one way

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"a link's bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"a link's latency must be a finite number >= 0 s, got {self.latency_s}")


@dataclass(frozen=True)
class LinkMatrix:
    """Each ordered pair of endpoints (stage names, and BROKER) -> the link from the first to the
    second, and each endpoint's host. A pair that is missing falls back to the sending stage's own
    `link_bandwidth` / `link_latency_s` (what a profile or a cluster file without hosts gives)."""

    links: Mapping[tuple[str, str], Link]  # (sender, receiver) -> link
    hosts: Mapping[str, str] = field(default_factory=dict)  # endpoint -> host it runs on ("" unknown)

    def link(self, sender: str, receiver: str) -> Link | None:
        return self.links.get((sender, receiver))

    def host(self, name: str) -> str:
        return self.hosts.get(name, "")


@dataclass(frozen=True)
class HostLinks:
    """Links described per pair of hosts (a cluster file's `[[links]]` and `[network]`)."""

    hosts: Mapping[str, str]  # stage (and optionally BROKER) -> host
    between: Mapping[frozenset, Link] = field(default_factory=dict)  # {host a, host b} -> link, both ways
    default: Link = Link()  # host pairs not listed in `between`
    within_host: Link = Link()  # two endpoints on one host

    def link(self, a: str, b: str) -> Link:
        host_a, host_b = self.hosts[a], self.hosts[b]
        if host_a == host_b:
            return self.within_host
        return self.between.get(frozenset((host_a, host_b)), self.default)

    def matrix(self, names: Sequence[str]) -> LinkMatrix:
        """The link between every ordered pair of `names` that have a host (the broker included
        when it has one)."""
        known = [name for name in names if name in self.hosts]
        if BROKER in self.hosts and BROKER not in known:
            known.append(BROKER)
        links = {(a, b): self.link(a, b) for a in known for b in known if a != b}
        return LinkMatrix(links, dict(self.hosts))

    def placing(self, registered: Mapping[str, str]) -> "HostLinks":
        """These links over live stages: each stage on the host it registered with (`registered`, stage
        -> host) unless these hosts name it (stages in containers or namespaces that share a host name)."""
        return HostLinks({**registered, **self.hosts}, self.between, self.default, self.within_host)
