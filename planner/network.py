"""Where each stage runs and what the link between any two of them costs: the planner's view of the
network, as plain values. Built from a cluster file's hosts, `[[links]]` and `[network]` table
(planner.cluster_file), or on a live cluster from the links the stages timed between them
(broker.link_probing) with a network file's links over the pairs it describes (`live_matrix`); the
placement planner reads it (planner.cost_model) to price each stage's send by the link to its actual successor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

BROKER = "broker"  # the broker's name in a matrix: it sends the first stage token ids, the last sends them back
# Where a live matrix's figures come from (LinkMatrix.sources), as `plan --explain` and the logs say it.
MEASURED, NETWORK_FILE, BROKER_PROBE, OWN_LINK = "measured", "network file", "broker's probe", "stage's own link"


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
    # (sender, receiver) -> where its figure came from (MEASURED, NETWORK_FILE, BROKER_PROBE); empty for a
    # cluster file's matrix, whose every link is described
    sources: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def link(self, sender: str, receiver: str) -> Link | None:
        return self.links.get((sender, receiver))

    def source(self, sender: str, receiver: str) -> str:
        """Where the pair's figure came from ("" where the matrix does not say)."""
        if (sender, receiver) not in self.links:
            return OWN_LINK if self.sources else ""
        return self.sources.get((sender, receiver), "")

    def host(self, name: str) -> str:
        return self.hosts.get(name, "")


@dataclass(frozen=True)
class HostLinks:
    """Links described per pair of hosts (a cluster file's `[[links]]` and `[network]`)."""

    hosts: Mapping[str, str]  # stage (and optionally BROKER) -> host
    between: Mapping[frozenset, Link] = field(default_factory=dict)  # {host a, host b} -> link, both ways
    default: Link = Link()  # host pairs not listed in `between`
    within_host: Link = Link()  # two endpoints on one host
    # Whether `default` / `within_host` were given (a network file's [network] fields) rather than left
    # unlimited: on a live cluster the pairs a file does not describe are measured (`covering`).
    default_given: bool = True
    within_given: bool = True

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

    def covering(self, a: str, b: str) -> Link | None:
        """The link between `a` and `b` where these links describe it (a `between` entry, or a default
        that was given); None where they leave it to be measured."""
        if a not in self.hosts or b not in self.hosts:
            return None
        host_a, host_b = self.hosts[a], self.hosts[b]
        if host_a == host_b:
            return self.within_host if self.within_given else None
        listed = self.between.get(frozenset((host_a, host_b)))
        return listed if listed is not None else (self.default if self.default_given else None)

    def placing(self, registered: Mapping[str, str]) -> "HostLinks":
        """These links over live stages: each stage on the host it registered with (`registered`, stage
        -> host) unless these hosts name it (stages in containers or namespaces that share a host name)."""
        return HostLinks({**registered, **self.hosts}, self.between, self.default, self.within_host,
                         self.default_given, self.within_given)


def live_matrix(hosts: Mapping[str, str], measured: Mapping[tuple[str, str], Link],
                broker_links: Mapping[str, Link], described: HostLinks | None = None,
                broker_host: str = "") -> LinkMatrix:
    """A live cluster's matrix over the stages of `hosts` (stage -> the host it registered with) and
    BROKER: a network file's links (`described`) over the pairs it covers, the stages' measured pairs
    over the rest, and the broker's probe of each stage (`broker_links`) both ways between it and the
    broker. A pair none of these gives is left out: the planner prices it by the sender's own link."""
    placed = described.placing(hosts) if described is not None else None
    where = dict(placed.hosts) if placed is not None else dict(hosts)
    where.setdefault(BROKER, broker_host)
    names = [*hosts, BROKER]
    links: dict[tuple[str, str], Link] = {}
    sources: dict[tuple[str, str], str] = {}
    for a in names:
        for b in names:
            if a == b:
                continue
            link, source = (placed.covering(a, b) if placed is not None else None), NETWORK_FILE
            if link is None and (a, b) in measured:
                link, source = measured[(a, b)], MEASURED
            if link is None and BROKER in (a, b):
                link, source = broker_links.get(b if a == BROKER else a), BROKER_PROBE
            if link is not None:
                links[(a, b)], sources[(a, b)] = link, source
    return LinkMatrix(links, where, sources)
