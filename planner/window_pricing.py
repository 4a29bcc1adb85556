"""How long one window of a job lasts on a chain of stages, from each stage's busy seconds alone.

CPU stages on one host share its cores and memory bandwidth, so a window lasts longer than its
busiest stage alone: stretched for want of cores, by the co-run factors the broker measured, by a
ring whose micro-batches start a host's stages in step, and by other chains' stages working on the
same hosts (`Neighbour`). The cost model (planner.cost_model) prices every window of every chain and
split the search tries with these functions, thousands per plan, so `window_s` is written for speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from layerbus.planner.plan_values import StageProfile
from layerbus.planner.workload import Window


@dataclass(frozen=True)
class Neighbour:
    """A stage of another chain working at the same time (planner.chain_plan). Where it shares a host's
    cores with this chain's stages, it slows them as a stage of the chain would; it is not part of
    the chain's own round trip."""

    profile: StageProfile
    busy: float  # share of the time it is busy (wanting its threads)
    cores: float  # cores it keeps computing on average: its busy time as if alone, less an emulated device's sleep


Neighbours = Sequence[Neighbour]

# Other chains may keep a host's cores busy; this chain is still given at least this share of them
# (the operating system's scheduler shares cores, it does not starve a process)
MIN_CORE_SHARE = 0.1


def window_s(alone: list[float], chain: Sequence[StageProfile], window: Window,
             num_micro_batches: int, latency: float | None = None,
             neighbours: Neighbours = ()) -> tuple[float, list[float]]:
    """(how long the window lasts, each stage's busy seconds in it) from each stage's busy seconds
    measured alone. CPU stages on one host share its cores and memory bandwidth. Where the broker
    measured it (`corun_factor`: the step with the host's other stages serving at once, over alone),
    the part of that factor that threads and cores do not explain stretches a stage in proportion to
    how busy the others are. Threads and cores: a stage computing while the others compute gets
    (cores / threads wanted) of what it wants, and the host cannot do more thread-seconds than it has
    cores; a stage emulating a slower device computes only `compute_share` of its busy time (it
    sleeps the rest, taking no core).
    `neighbours`, other chains' stages busy at the same time, take their share of a host's cores and
    count among the others a stage co-runs with."""
    steps = max(window.work.steps, 1e-12)
    if latency is None:  # one step's one-way latencies round the chain, each stage's own link
        latency = sum(s.link_latency_s for s in chain)
    # What does not change from one round of the fixed point to the next is worked out once: the planner
    # prices thousands of chains and splits, 16 windows each, and working out the hosts, who shares them
    # and the host bound again every round made this function most of a plan's time.
    host_bound = _host_bound(alone, chain, neighbours)
    in_step = _in_step_groups(chain, window, num_micro_batches, neighbours)
    # Started together, a host's stages compute at the same time whenever one does, however idle the ring
    # leaves them: each is stretched as if the others were always busy (they are, while it computes)
    together = {k for on, _ in in_step for k in on}
    # Per stage sharing a host: the others of this chain there (index, threads, compute share), what the
    # other chains' stages there want (`_cores_stretch`'s terms for them: they do not change), and the
    # stretch with every one of them busy. The rounds below do `_cores_stretch`'s arithmetic inline, in
    # its order, so the figures are the same to the last bit (tests/unit/test_window_reference.py keeps the plain
    # version and compares them on random chains).
    sharers: list[tuple | None] = []
    for k, s in enumerate(chain):
        others = [(j, max(1, o.threads), o.compute_share) for j, o in enumerate(chain) if j != k and _on(o, s.host)]
        near = [(n.profile, min(1.0, n.busy)) for n in neighbours if _on(n.profile, s.host)]
        if not s.shares_cores or not (others or near):
            sharers.append(None)  # alone on its host (or not sharing cores): never stretched
            continue
        near_terms = [max(1, o.threads) * share * o.compute_share for o, share in near]
        near_shares = [share for _, share in near]
        at_full = (_cores_stretch(s, [(chain[j], 1.0) for j, _, _ in others] + [(o, 1.0) for o, _ in near])
                   if s.corun_factor > 0 else 0.0)
        sharers.append((others, near_terms, near_shares, at_full, max(1, s.threads)))
    busy = list(alone)
    time = 0.0
    for _ in range(8):  # a fixed point: the stretch depends on how busy the others are, and back
        time = _round_s(busy, window, steps, latency, host_bound, in_step)
        if time <= 0:
            return 0.0, busy
        stretched = []
        for k, (b, s) in enumerate(zip(alone, chain)):
            shared = sharers[k]
            if shared is None:
                stretched.append(b)
                continue
            others, near_terms, near_shares, at_full, own_threads = shared
            # The others' shares of the time they are busy, as this stage sees them
            shares = [1.0] * len(others) if k in together else [min(1.0, busy[j] / time) for j, _, _ in others]
            wanted_others = 0
            for (_, threads, compute_share), share in zip(others, shares):
                wanted_others += threads * share * compute_share
            for term in near_terms:
                wanted_others += term
            cores = max(1.0, (own_threads + wanted_others) / s.host_cores * s.compute_share)  # _cores_stretch
            if s.corun_factor > 0:
                # Measured with every stage of the host busy at once. Cores explain part of that (four
                # one-thread stages on two cores: 2x), and that part shrinks as the others idle; only
                # the rest (memory bandwidth, caches) scales with how busy they are. All of it scaled
                # that way predicted a 27-layer stage beside three nearly idle ones 14% slower than it
                # ran (bench/bench_topology.py). A factor under what cores explain
                # (threads that did not scale: two 2-thread stages on 2 cores measured ~1.5x, not 2x)
                # is what the cores' part rises to at full load.
                if at_full > 1:
                    cores = 1 + (min(s.corun_factor, at_full) - 1) * (cores - 1) / (at_full - 1)
                rest = max(1.0, s.corun_factor / at_full)
                overlap = sum(shares + near_shares) / (len(shares) + len(near_shares))
                stretched.append(b * cores * (1 + (rest - 1) * overlap))
            else:
                stretched.append(b * cores)
        if stretched == busy:  # the fixed point: every further round would compute the same
            break
        busy = stretched
    return max(time, max(busy, default=0.0)), busy


def _host_bound(alone: list[float], chain: Sequence[StageProfile], neighbours: Neighbours) -> float:
    """The least a window lasts for the cores its hosts have: the thread-seconds the stages of a host
    want, over its cores (less what other chains' stages there keep busy). Not for a host whose stages
    were measured together: their co-run factors hold the cores' share too."""
    host_bound = 0.0
    for host, cores in _hosts(chain).items():
        if any(s.corun_factor > 0 for s in chain if _on(s, host)):
            continue  # measured together: the factors hold the cores' share too
        demand = sum(b * s.compute_share * max(1, s.threads) for b, s in zip(alone, chain) if _on(s, host))
        taken = sum(n.cores for n in neighbours if _on(n.profile, host))
        host_bound = max(host_bound, demand / max(cores - taken, MIN_CORE_SHARE * cores))
    return host_bound


def _in_step_groups(chain: Sequence[StageProfile], window: Window, num_micro_batches: int,
                    neighbours: Neighbours) -> list[tuple[list[int], float]]:
    """Per host whose stages the ring starts in step, (those stages' places in the chain, the seconds the
    window's steps last longer for it: steps x the host's measured `lockstep_excess_s`; its stages are
    stretched as if always computing together, as they do whenever one computes). A ring of at most
    one micro-batch per stage plus the one at the broker keeps every stage waiting on its neighbour, so the
    host's stages start their steps together and the ring waits for the last to finish: the trace of the
    README's command (3 one-thread stages on 2 cores) showed decode steps of 1.63-1.74x alone where the
    co-run factors priced 1.47x. With more micro-batches, or other chains' stages on the host, each stage
    has work queued and serves at its own pace (what the co-run factors measure)."""
    if num_micro_batches > len(chain) + 1 or window.work.steps <= 0:
        return []
    groups = []
    for host in _hosts(chain):
        on = [k for k, s in enumerate(chain) if _on(s, host)]
        excess = max(chain[k].lockstep_excess_s for k in on)
        if len(on) >= 2 and excess > 0 and not any(_on(n.profile, host) for n in neighbours):
            groups.append((on, window.work.steps * excess))
    return groups


def window_floor_s(alone: list[float], chain: Sequence[StageProfile], window: Window, latency: float,
                   neighbours: Neighbours = ()) -> float:
    """What `window_s` gives at least: its first round, before any stage is stretched (a stretch only
    lengthens busy times, so every bound it takes the largest of only grows; the ring's in-step bound,
    left out, only adds to it)."""
    time = _round_s(alone, window, max(window.work.steps, 1e-12), latency, _host_bound(alone, chain, neighbours))
    return time if time > 0 else 0.0


def _round_s(busy: list[float], window: Window, steps: float, latency: float, host_bound: float,
             in_step: Sequence[tuple[list[int], float]] = ()) -> float:
    """How long a window lasts at these busy times: its busiest stage, its busiest micro-batch's steps
    through the whole chain, its hosts' cores, or a host's stages started in step (`_in_step_groups`: the
    busiest of them and the ring's wait for the last each step), whichever is longest."""
    chain_bound = window.longest_chain * (sum(busy) / steps + latency)
    time = max(max(busy, default=0.0), chain_bound, host_bound)
    for on, extra in in_step:
        time = max(time, max(busy[k] for k in on) + extra)
    return time


def _cores_stretch(stage: StageProfile, sharing: Sequence[tuple[StageProfile, float]]) -> float:
    """How much longer `stage`'s steps last for want of cores, while each other stage of its host is busy
    the given share of the time: it gets (cores / threads wanted) of what it wants. An emulated slower
    device computes only `compute_share` of its busy time (it sleeps the rest, taking no core), and its
    steps last their CPU time / that share (stages/emulation.py): computing slower stretches them only
    past 1 / compute_share."""
    wanted = max(1, stage.threads) + sum(max(1, other.threads) * share * other.compute_share for other, share in sharing)
    return max(1.0, wanted / stage.host_cores * stage.compute_share)


def _hosts(chain: Sequence[StageProfile]) -> dict[str, int]:
    return {s.host: s.host_cores for s in chain if s.shares_cores}


def _on(stage: StageProfile, host: str) -> bool:
    return stage.shares_cores and stage.host == host
