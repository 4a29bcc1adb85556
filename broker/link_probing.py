"""The broker's side of the measured link matrix: once stages have registered and been
profiled, it asks one stage at a time to time its links to the others (stages/peer_links.py: round
trips and bandwidth at one step's size, with wire/link_probe.py), and keeps each ordered pair's figures.

One stage at a time, so that no two probes share a machine's cores or a link while they are timed.
A pair already measured is kept (re-plans reuse the survivors' pairs); only pairs with a stage new to
the broker are timed. A pair that could not be timed is logged with both stages' names and left out:
the planner then prices it by the sending stage's own link (its probe from the broker).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Mapping

from layerbus.broker.control import ControlPlane, StageInfo
from layerbus.broker.waits import Liveness, Reply, Steps, run_blocking
from layerbus.planner.network import Link
from layerbus.wire import protocol

log = logging.getLogger("layerbus.broker")


@dataclass(frozen=True)
class LinkProbeConfig:
    """How the broker has its stages time the links between them."""

    enabled: bool = True  # False (--no-link-probe): each stage's own link (its probe from the broker) prices its sends
    burst_s: float = 0.05  # each pair's bandwidth comes from a burst at least this long (longer on slow or bursty links)
    echoes: int = 5  # round trips timed per pair; the median counts
    connect_timeout_s: float = 3.0  # a peer's first answer (its connection and handshake) must come within this

    def __post_init__(self) -> None:
        if not (0 < self.burst_s <= 60 and self.echoes >= 1 and 0 < self.connect_timeout_s <= 300):
            raise ValueError(f"link probes need 0 < burst_s <= 60, echoes >= 1 and 0 < connect_timeout_s <= 300, got "
                             f"{self.burst_s=}, {self.echoes=}, {self.connect_timeout_s=}")

    def stage_timeout_s(self, peers: int) -> float:
        """How long one stage may take to time `peers` links: each peer's first answer, its echoes, and
        bursts that grow to `burst_s` (about twice that in all), with room for a loaded machine."""
        per_peer = self.connect_timeout_s * (1 + self.echoes) + 10 * self.burst_s + 2.0
        return 5.0 + peers * per_peer


@dataclass(frozen=True)
class MeasuredLink:
    """One ordered pair's figures, as the sending stage timed them."""

    bytes_per_s: float
    round_trip_s: float

    def link(self) -> Link:
        return Link(self.bytes_per_s, self.round_trip_s / 2)


Pair = tuple[str, str]


def missing_pairs(stages: list[StageInfo], measured: Mapping[Pair, MeasuredLink]) -> dict[str, list[StageInfo]]:
    """Stage name -> the peers it has no measured link to (in the stages' order), for those with any."""
    return {stage.name: peers for stage in stages
            if (peers := [peer for peer in stages if peer is not stage and (stage.name, peer.name) not in measured])}


def link_probe_steps(control: ControlPlane, stages: list[StageInfo], measured: Mapping[Pair, MeasuredLink],
                     step_bytes: int, rows: int, config: LinkProbeConfig) -> Steps[dict[Pair, MeasuredLink]]:
    """The conversation (broker/waits.py) that times the pairs of `stages` not in `measured`, each by its
    sender, one stage at a time; pairs that could not be timed are logged and left out. A stage asked
    that leaves or falls silent meanwhile ends it with StageLost (as profiling)."""
    wanted = missing_pairs(stages, measured)
    if not wanted:
        return {}
    started = time.monotonic()
    if control.keys is not None:
        yield from _admit(control, stages, config.connect_timeout_s)
    found: dict[Pair, MeasuredLink] = {}
    by_name = {stage.name: stage for stage in stages}
    for name, peers in wanted.items():
        stage = by_name[name]
        control.send(stage, protocol.LINK_PROBE, step_bytes=step_bytes, rows=rows, echoes=config.echoes,
                     burst_s=float(config.burst_s), connect_timeout_s=float(config.connect_timeout_s),
                     peers=[_peer_entry(peer) for peer in peers])
        timeout_s = config.stage_timeout_s(len(peers))
        answer = yield Reply(stage, protocol.LINK_PROBE_RESULT, timeout_s, required=False)
        if answer is None:
            log.warning("stage %s sent no %s within %.0f s", stage.name, protocol.LINK_PROBE_RESULT, timeout_s)
        found.update(read_answer(stage.name, [peer.name for peer in peers], answer))
    log.info("timed %d of %d link(s) between %d stages in %.2f s", len(found), sum(map(len, wanted.values())),
             len(stages), time.monotonic() - started)
    return found


def probe_links(control: ControlPlane, stages: list[StageInfo], measured: Mapping[Pair, MeasuredLink],
                step_bytes: int, rows: int, config: LinkProbeConfig, liveness: Liveness) -> dict[Pair, MeasuredLink]:
    """link_probe_steps, run here (nothing else going on: the broker starts or re-plans)."""
    return run_blocking(control, link_probe_steps(control, stages, measured, step_bytes, rows, config), liveness)


def read_answer(sender: str, peers: list[str], answer: dict | None) -> dict[Pair, MeasuredLink]:
    """The measured pairs in a stage's link_probe_result; what is missing or wrong is logged, naming both
    stages, and left out (the sender's own link prices it then)."""
    if answer is None or "error" in answer or not isinstance(answer.get("links"), list):
        why = "no answer in time" if answer is None else answer.get("error", f"unreadable answer {answer!r:.80}")
        log.warning("links from stage %s to %s not timed (%s): its own link prices them", sender, ", ".join(peers), why)
        return {}
    found = {}
    entries = {entry.get("peer"): entry for entry in answer["links"] if isinstance(entry, dict)}
    for peer in peers:
        entry = entries.get(peer, {"error": "the stage did not report it"})
        rate, trip = entry.get("bytes_per_s"), entry.get("round_trip_s")
        if "error" in entry or not _positive(rate) or not _positive(trip, zero=True):
            log.warning("link %s -> %s not timed (%s): %s's own link prices it", sender, peer,
                        entry.get("error", f"figures {rate!r}, {trip!r}"), sender)
            continue
        found[(sender, peer)] = MeasuredLink(float(rate), float(trip))
    return found


def _positive(value: object, zero: bool = False) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and (value >= 0 if zero else value > 0))


def _peer_entry(peer: StageInfo) -> dict:
    entry = {"name": peer.name, "address": peer.data_address}
    if peer.public_key is not None:
        entry["key"] = peer.public_key
    return entry


def _admit(control: ControlPlane, stages: list[StageInfo], timeout_s: float) -> Steps[None]:
    """Secured: every stage's data port admits the others' keys for the probes (its next assignment
    admits only its hop before again); each says so before any probe starts."""
    keys = sorted({stage.public_key for stage in stages if stage.public_key is not None})
    for stage in stages:
        control.send(stage, protocol.LINK_ADMIT, keys=keys)
    deadline = time.monotonic() + timeout_s
    silent = []
    for stage in stages:  # the answers come in any order: one that came early waits for its turn
        answer = yield Reply(stage, protocol.LINK_ADMITTED, max(0.0, deadline - time.monotonic()), required=False)
        if answer is None:
            silent.append(stage.name)
    if silent:
        log.warning("stage(s) %s did not say within %.0f s that they admit the others' probes: theirs may fail",
                    sorted(silent), timeout_s)
