"""Placing a model's layers on mismatched stages: which stages, in which order, which layers each.

A pure function over each stage's measured (or described) profile and the model's exact memory
needs. A pipeline with more micro-batches than stages runs at the pace of its slowest stage, so
the plan minimizes the slowest stage's time per pipeline step: its layers, the embedding on the
first stage, the LM head on the last, plus sending its activations on. Each stage must hold its
weights, the KV cache of its layers for every slot at the full context length, an activation
workspace and a reserve within its memory budget. It is solved exactly by dynamic programming
over (stages used, layers placed), which also picks the order of the stages (where the head and
the embedding go matters) and leaves out a stage that would only slow the chain. Given a link
matrix (planner.network: hosts, and the link between each pair of stages), each stage's send is priced
by the link to the stage after it, and the search is the one in broker.link_search.

A pipeline step here is what yields one new token per slot of a micro-batch: `micro_batch_size`
decode rows plus the prompt tokens the workload brings along per generated token
(`PlanOptions.prompt_tokens_per_new_token`), so predicted tokens/s count new tokens.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Sequence

from layerbus.planner.partition import equal_partition
from layerbus.planner.plan_values import (  # noqa: F401  (the planner's vocabulary is imported from here too)
    ModelMemory,
    PlacementError,
    Plan,
    PlanOptions,
    Shapes,
    SplitEstimate,
    StagePlacement,
    StageProfile,
)
from layerbus.planner.link_search import host_grouped_orders, pair_dp
from layerbus.planner.link_search import prefer_more_stages as _prefer_more_stages
from layerbus.planner.network import BROKER, Link, LinkMatrix
from layerbus.planner.step_cost import StepWork
from layerbus.planner.weight_choice import AUTO_FALLBACKS, auto_levels, first_that_fits, weight_candidates
from layerbus.planner.workload import JobShape, Window, steady_shape
from layerbus.wire.spans import LayerRange

# A quantized format measured at most this share of full precision's time is worth a line in `plan
# --explain` (clearly faster than the ratio's noise of a few percent)
FASTER_FORMAT = 0.8
SUBSET_DP_LIMIT = 6_000_000  # inner-loop steps above which the order search falls back to (first, last) pairs


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


# -- the cost model ---------------------------------------------------------------------------------

class _CostModel:
    """Per-stage time and memory of holding layers [start, end), as the search and the estimates see them.

    Time is priced per window of the job (`JobShape`): each stage's busy seconds in a window are its
    profile's linear cost of what the window's steps carry (planner.step_cost), and the window lasts
    as long as its slowest stage, stretched where CPU stages on one host want more cores than it
    has, and at least as long as its busiest micro-batch's steps take through the whole chain.

    Memory is priced in each stage's weight format: the one it asked for, or under `--weights auto`
    the first of full precision and the first `level` of int8, int4 that fits its span
    (planner.weight_choice)."""

    def __init__(self, stages: Sequence[StageProfile], model: ModelMemory, shapes: Shapes, options: PlanOptions,
                 job: JobShape | None = None, network: LinkMatrix | None = None, level: int = len(AUTO_FALLBACKS),
                 neighbours: Neighbours = ()):
        self.stages, self.model, self.shapes, self.options = list(stages), model, shapes, options
        self.network = network
        self.neighbours = tuple(neighbours)
        n = model.num_layers
        self.level = level
        self.known_formats = tuple(f.name for f in model.formats)
        self.weight_prefixes: dict[str, list[int]] = {}
        self.chosen_formats: dict[tuple[str, int, int], str | None] = {}
        self.job = job if job is not None else steady_shape(
            shapes.micro_batch_size, shapes.num_micro_batches, options.prompt_tokens_per_new_token,
            min(256, shapes.max_context // 2), shapes.max_step_tokens)
        self.windows = [w for w in self.job.windows if w.work.steps > 0]
        self.total = self.job.total
        self.steps = max(self.total.steps, 1e-12)
        self.kv_per_layer = model.kv_bytes_per_token * shapes.kv_positions
        # A stage that sends on keeps what it sent, one hidden state per slot-position and prefix position,
        # so that a re-plan replays only the layers that moved (stages.replay).
        self.sent_bytes = model.activation_bytes_per_token * shapes.kv_positions if shapes.keep_sent else 0
        self.num_layers = n
        self.shared = any(s.shares_cores for s in self.stages)

    # -- links --
    def link(self, s: StageProfile, receiver: str) -> Link:
        """The link `s` sends to `receiver` (a stage's name or BROKER) over: the matrix's, else the
        stage's own (a profile or a cluster file without hosts knows only that one)."""
        known = self.network.link(s.name, receiver) if self.network is not None else None
        return known if known is not None else Link(s.link_bandwidth, s.link_latency_s)

    def latency_s(self, chain: Sequence[StageProfile]) -> float:
        """One-way latencies of one step's way round: broker -> each stage in turn -> broker."""
        if self.network is None:
            return sum(s.link_latency_s for s in chain)
        first = self.network.link(BROKER, chain[0].name) if chain else None
        return (first.latency_s if first else 0.0) + sum(self.link(s, _name_after(chain, k)).latency_s
                                                         for k, s in enumerate(chain))

    # -- time --
    def busy_s(self, s: StageProfile, start: int, end: int, work: StepWork, receiver: str = BROKER) -> float:
        """Seconds stage `s` is busy for `work` holding [start, end): compute plus sending on to `receiver`."""
        return (s.busy_s(work, end - start, start == 0, end == self.num_layers, self.held_format(s, start, end))
                + self.send_s(s, end, work, receiver))

    def mean_send_s(self, s: StageProfile, end: int, receiver: str) -> float:
        """Mean seconds per step `s` spends sending to `receiver` over the job, holding [.., end)."""
        return self.send_s(s, end, self.total, receiver) / self.steps

    def compute_s(self, s: StageProfile, start: int, end: int) -> float:
        """Mean seconds per step `s` computes holding [start, end) over the job, sending aside."""
        return s.busy_s(self.total, end - start, start == 0, end == self.num_layers,
                        self.held_format(s, start, end)) / self.steps

    def send_s(self, s: StageProfile, end: int, work: StepWork, receiver: str = BROKER) -> float:
        if end == self.num_layers:
            return 0.0  # the last stage returns a few token ids
        bandwidth = s.link_bandwidth if self.network is None else self.link(s, receiver).bandwidth
        return work.positions * self.model.activation_bytes_per_token / bandwidth

    def step_s(self, s: StageProfile, start: int, end: int, receiver: str = BROKER) -> float:
        """Mean busy seconds per step over the job, unstretched: what the search balances."""
        return self.busy_s(s, start, end, self.total, receiver) / self.steps

    def job_floor_s(self, chain: Sequence[StageProfile], spans: Sequence[LayerRange]) -> float:
        """A floor under `job_s`'s seconds, at a fraction of its cost: each window's `window_floor_s`."""
        latency = self.latency_s(chain)
        return sum(window_floor_s(self.alone_s(chain, spans, window), chain, window, latency, self.neighbours)
                   for window in self.windows)

    def alone_s(self, chain: Sequence[StageProfile], spans: Sequence[LayerRange], window: Window) -> list[float]:
        """Each stage's busy seconds in `window` as if it had its host to itself."""
        return [self.busy_s(s, sp.start, sp.end, window.work, _name_after(chain, k))
                for k, (s, sp) in enumerate(zip(chain, spans))]

    def job_s(self, chain: Sequence[StageProfile], spans: Sequence[LayerRange]) -> tuple[float, list[float]]:
        """(seconds the job takes, each stage's busy seconds over it) for this chain and split."""
        total, busy = 0.0, [0.0] * len(chain)
        latency = self.latency_s(chain)
        for window in self.windows:
            alone = self.alone_s(chain, spans, window)
            time, stretched = window_s(alone, chain, window, self.shapes.num_micro_batches, latency, self.neighbours)
            total += time
            busy = [b + x for b, x in zip(busy, stretched)]
        return total, busy

    # -- memory --
    def weight_bytes(self, start: int, end: int, weights: str = "auto") -> int:
        """Bytes of [start, end) and the ends it holds, in format `weights` ("auto": full precision)."""
        sizes = self.model.weights_in(weights)
        prefix = self.weight_prefixes.get(sizes.name)
        if prefix is None:
            prefix = self.weight_prefixes[sizes.name] = list(itertools.accumulate(sizes.layer_weight_bytes, initial=0))
        first, last = start == 0, end == self.num_layers
        size = prefix[end] - prefix[start]
        if first:
            size += sizes.embed_bytes
        if last:
            size += sizes.head_bytes - (sizes.embed_bytes if first and self.model.head_shares_embed else 0)
        return size

    def candidates(self, s: StageProfile) -> tuple[str, ...]:
        return weight_candidates(s.weights, self.model.full_format, self.level, self.known_formats)

    def weight_format(self, s: StageProfile, start: int, end: int) -> str | None:
        """The format `s` holds [start, end) in: the first candidate whose weights fit beside the span's
        KV cache, workspace and reserve; None when none fits."""
        key = (s.name, start, end)
        if key not in self.chosen_formats:
            room = s.memory_budget - self.cache_bytes(start, end) - self.workspace_bytes(end) - self.reserve_bytes(s)
            self.chosen_formats[key] = first_that_fits(self.candidates(s),
                                                       lambda name: self.weight_bytes(start, end, name), room)
        return self.chosen_formats[key]

    def held_format(self, s: StageProfile, start: int, end: int) -> str:
        """The format `s` is priced in for [start, end): the one that fits, else the smallest (the span
        is then over budget, which `fits` refuses)."""
        return self.weight_format(s, start, end) or self.candidates(s)[-1]

    def cache_bytes(self, start: int, end: int) -> int:
        """The KV cache of [start, end), plus the hidden states kept of what is sent on (not by the last stage)."""
        return (end - start) * self.kv_per_layer + (self.sent_bytes if end < self.num_layers else 0)

    def workspace_bytes(self, end: int) -> int:
        return self.model.workspace_bytes(self.shapes.max_step_tokens, self.shapes.micro_batch_size,
                                          self.shapes.max_context, end == self.num_layers)

    def reserve_bytes(self, s: StageProfile) -> int:
        return int(s.memory_budget * self.options.reserve_fraction)

    def fits(self, s: StageProfile, start: int, end: int) -> bool:
        return self.weight_format(s, start, end) is not None

    def estimate(self, chain: Sequence[StageProfile], spans: Sequence[LayerRange]) -> SplitEstimate:
        job_s, busy = self.job_s(chain, spans)
        placements = []
        for k, (s, span, stage_busy) in enumerate(zip(chain, spans, busy)):
            start, end, receiver = span.start, span.end, _name_after(chain, k)
            send = self.send_s(s, end, self.total, receiver) / self.steps
            link = self.link(s, receiver)
            weights = self.held_format(s, start, end)
            next_layer = self.model.weights_in(weights).layer_weight_bytes[min(end, self.num_layers - 1)]
            placements.append(StagePlacement(
                name=s.name, layers=LayerRange(start, end), is_first=start == 0, is_last=end == self.num_layers,
                memory_budget=s.memory_budget, weight_bytes=self.weight_bytes(start, end, weights),
                kv_bytes=self.cache_bytes(start, end), workspace_bytes=self.workspace_bytes(end),
                reserve_bytes=self.reserve_bytes(s), compute_s=max(0.0, stage_busy / self.steps - send),
                send_s=send, latency_s=link.latency_s, layer_s=s.layer_in(weights).of(self.total) / self.steps,
                layer_bytes=next_layer + self.kv_per_layer, alone_s=self.step_s(s, start, end, receiver),
                host=self.host_of(s), link_bandwidth=link.bandwidth, weights=weights, requested_weights=s.weights,
                format_speed=s.format_speed(weights), faster_format=self.faster_format(s, weights)))
        first = self.network.link(BROKER, chain[0].name) if self.network is not None and chain else None
        return summarize(tuple(placements), self.shapes, job_s, self.job.new_tokens, self.steps,
                         first.latency_s if first else 0.0)

    def faster_format(self, s: StageProfile, held: str) -> tuple[str, float] | None:
        """A quantized format `s` measured at most FASTER_FORMAT of full precision's time, where auto
        holds full precision: auto does not trade quality for it, the plan's text tells the user."""
        if s.weights != "auto" or held in AUTO_FALLBACKS:
            return None
        speeds = [(speed, name) for name in AUTO_FALLBACKS
                  if (speed := s.format_speed(name)) is not None and speed <= FASTER_FORMAT]
        return (min(speeds)[1], min(speeds)[0]) if speeds else None

    def host_of(self, s: StageProfile) -> str:
        return (self.network.host(s.name) if self.network is not None else "") or s.host


def _name_after(chain: Sequence[StageProfile], k: int) -> str:
    """Who stage k of the chain sends to: the next stage, or the broker after the last."""
    return chain[k + 1].name if k + 1 < len(chain) else BROKER


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
    # prices thousands of chains and splits, 16 windows each (23 s of the README command's start-up here,
    # 90% of it in this function, when every round recomputed the hosts, who shares them and the host bound).
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
                # that way predicted a 27-layer stage beside three nearly idle ones 14%
                # slower than it ran (bench_topology, issue 21). A factor under what cores explain
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


def summarize(placements: tuple[StagePlacement, ...], shapes: Shapes, job_s: float | None = None,
              new_tokens: float | None = None, steps: float | None = None,
              broker_latency_s: float = 0.0) -> SplitEstimate:
    """Pace, round trip, tokens/s and bubble of a chain. Without a job's figures: one step per
    micro-batch in flight, where the chain runs at its slowest stage's pace unless one step's round
    trip exceeds m of those. `broker_latency_s`: the broker's link to the first stage, one way."""
    step = max(p.step_s for p in placements)
    round_trip = sum(p.step_s + p.latency_s for p in placements) + broker_latency_s
    if job_s is None:
        cycle = max(step, round_trip / max(1, shapes.num_micro_batches))
        steps = float(max(1, shapes.num_micro_batches))
        job_s, new_tokens = cycle * steps, shapes.micro_batch_size * steps
    tokens = new_tokens / job_s if job_s > 0 else math.inf
    bubble = 1.0 - sum(p.step_s for p in placements) * steps / (len(placements) * job_s) if job_s > 0 else 0.0
    return SplitEstimate(placements, step, round_trip, tokens, bubble, job_s, new_tokens, steps)


# -- the planner ------------------------------------------------------------------------------------

def plan_placement(stages: Sequence[StageProfile], model: ModelMemory, batching,
                   options: PlanOptions = PlanOptions(), job: JobShape | None = None,
                   network: LinkMatrix | None = None, neighbours: Neighbours = ()) -> Plan:
    """The placement that finishes the job soonest within every stage's memory.

    `stages` is any set of profiles (their order is the chain order when `allow_reorder` is off,
    and the equal split's order); `batching` is a BatchingConfig (resolved for len(stages) if it is
    not); `job` is the job's windows (broker.workload.job_shape; None: a steady mix of decode and
    `options.prompt_tokens_per_new_token`); `network` the links between the stages (None: each
    stage sends at its own `link_bandwidth`, whoever follows it); `neighbours` other chains' stages
    working beside this chain (window_s). Raises PlacementError when no placement fits."""
    if not stages:
        raise PlacementError("no stages to place the model on: start at least one stage")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise PlacementError(f"stage names must be unique, got {names}")
    shapes = batching if isinstance(batching, Shapes) else Shapes.from_batching(batching, len(stages))
    # Stages under --weights auto: full precision first; int8, then int4, only if that finds no placement.
    levels = ([level for level in auto_levels() if level <= options.max_auto_level]
              if any(s.weights == "auto" for s in stages) else [len(AUTO_FALLBACKS)])
    for level in levels:
        costs = _CostModel(stages, model, shapes, options, job, network, level, neighbours)
        if network is None:
            chain, spans, search = _search(costs, options)
        else:
            chain, spans, search = _search_over_links(costs, options)
        if chain:
            break
    if not chain:
        raise PlacementError(_too_small_message(costs))
    if len(costs.windows) > 1 or costs.shared:
        chain, spans = _by_job_time(costs, options, chain, spans)
    if network is None or _links_alike(network, names):  # else the order carries the topology: no tie
        chain = _given_order_if_close(costs, options, stages, chain, spans)
    chosen = costs.estimate(chain, spans)
    used = {s.name for s in chain}
    equal = None
    if len(stages) <= model.num_layers:
        equal = costs.estimate(stages, equal_partition(model.num_layers, len(stages)))
    blind = None
    if network is not None:  # what ignoring the network would have cost on it
        ignoring = plan_placement(stages, model, shapes, options, job, neighbours=neighbours)
        by_name = {s.name: s for s in stages}
        blind = costs.estimate([by_name[name] for name in ignoring.order], ignoring.spans)
    return Plan(chosen, tuple(n for n in names if n not in used), equal, shapes, options, job, network, search, blind)


LINKS_ALIKE_RATIO = 2.0  # stage-to-stage bandwidths within this factor of each other: no topology to keep


def _links_alike(network: LinkMatrix, names: Sequence[str]) -> bool:
    """True when the links between these stages barely differ (local stages timing each other over
    loopback: 4.9-5.3 Gbit/s here), so the chain's order carries no topology and a near tie may go to
    the given (name) order, as without a network; False when some pair is much slower than another."""
    bandwidths = [link.bandwidth for a in names for b in names if a != b
                  for link in (network.link(a, b),) if link is not None]
    return not bandwidths or max(bandwidths) <= LINKS_ALIKE_RATIO * min(bandwidths)


def _given_order_if_close(costs: _CostModel, options: PlanOptions, stages: Sequence[StageProfile],
                          chain: list[StageProfile], spans: list[LayerRange]) -> list[StageProfile]:
    """The chosen stages in the order they were given, on the same spans, when that fits and is
    predicted within `options.reorder_tolerance` of the chosen order's job time; else the chain."""
    chosen = {s.name for s in chain}
    given = [s for s in stages if s.name in chosen]
    if [s.name for s in given] == [s.name for s in chain]:
        return chain
    if not all(costs.fits(s, span.start, span.end) for s, span in zip(given, spans)):
        return chain
    if costs.job_s(given, spans)[0] <= costs.job_s(chain, spans)[0] * (1 + options.reorder_tolerance):
        return given
    return chain


def estimate_split(stages: Sequence[StageProfile], spans: Sequence[LayerRange], model: ModelMemory, batching,
                   options: PlanOptions = PlanOptions(), job: JobShape | None = None,
                   network: LinkMatrix | None = None, neighbours: Neighbours = ()) -> SplitEstimate:
    """The figures of a given chain and split (an equal split, a split in use) under the same model."""
    if len(stages) != len(spans):
        raise ValueError(f"{len(stages)} stages but {len(spans)} spans")
    shapes = batching if isinstance(batching, Shapes) else Shapes.from_batching(batching, len(stages))
    return _CostModel(stages, model, shapes, options, job, network, neighbours=neighbours).estimate(stages, spans)


ENUMERATION_LIMIT = 4000  # candidate chains x splits priced window by window; beyond, improve the DP's answer


def _by_job_time(costs: _CostModel, options: PlanOptions, chain: list[StageProfile],
                 spans: list[LayerRange]) -> tuple[list[StageProfile], list[LayerRange]]:
    """The DP balances each stage's total over the job; phases (prefill, decode, the drain) and
    stages sharing a host's cores make the job's time more than the slowest total. Price candidates
    window by window: every chain and split when they are few, else the DP's answer with its cuts
    moved one layer at a time while that helps."""
    n, stages = costs.num_layers, costs.stages
    sizes = range(1, len(stages) + 1) if options.allow_drop else [len(stages)]
    count = sum(math.perm(len(stages), k) * math.comb(n - 1, k - 1) for k in sizes if k <= n)
    if count <= ENUMERATION_LIMIT:
        fitting = []
        for k in sizes:
            if k > n:
                continue
            orders = itertools.permutations(stages, k) if options.allow_reorder else itertools.combinations(stages, k)
            for order in orders:
                for cuts in itertools.combinations(range(1, n), k - 1):
                    bounds = (0, *cuts, n)
                    split = [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]
                    if all(costs.fits(s, sp.start, sp.end) for s, sp in zip(order, split)):
                        fitting.append((list(order), split))
        if not fitting:
            return chain, spans
        # Priced from the lowest floor up, until the floors pass what could still be chosen: the fastest
        # so far, within the tolerance that prefers more stages. A candidate left unpriced is slower than
        # that, so the choice is the one pricing all of them gives (the README command's 2,613 candidates,
        # twice: most of its plan's 23 s, when every one was priced).
        floors = [costs.job_floor_s(order, split) for order, split in fitting]
        priced: dict[int, float] = {}
        fastest = math.inf
        for i in sorted(range(len(fitting)), key=floors.__getitem__):
            if floors[i] > fastest * (1 + options.drop_tolerance) + 1e-15:
                break  # every later floor is higher still
            priced[i] = costs.job_s(*fitting[i])[0]
            fastest = min(fastest, priced[i])
        candidates = [(priced[i], order, split) for i, (order, split) in enumerate(fitting) if i in priced]
        best = _prefer_more_stages(candidates, lambda c: c[0], lambda c: len(c[1]), options.drop_tolerance)
        return best[1], best[2]
    best_time = costs.job_s(chain, spans)[0]
    improved = True
    while improved:
        improved = False
        for i in range(len(spans) - 1):
            for delta in (-1, 1):
                cut = spans[i].end + delta
                if not spans[i].start < cut < spans[i + 1].end:
                    continue
                trial = list(spans)
                trial[i], trial[i + 1] = LayerRange(spans[i].start, cut), LayerRange(cut, spans[i + 1].end)
                if not (costs.fits(chain[i], trial[i].start, trial[i].end)
                        and costs.fits(chain[i + 1], trial[i + 1].start, trial[i + 1].end)):
                    continue
                time = costs.job_s(chain, trial)[0]
                if time < best_time * (1 - 1e-9):
                    spans, best_time, improved = trial, time, True
    return chain, spans


def _search(costs: _CostModel, options: PlanOptions) -> tuple[list[StageProfile], list[LayerRange], str]:
    stages, n = costs.stages, costs.num_layers
    p = len(stages)
    # step[s][start][end] for stages that fit, else inf: every DP below reads only this table.
    inf = math.inf
    step = [[[inf] * (n + 1) for _ in range(n + 1)] for _ in range(p)]
    for i, s in enumerate(stages):
        for start in range(n):
            for end in range(start + 1, n + 1):
                if costs.fits(s, start, end):
                    step[i][start][end] = costs.step_s(s, start, end)
    if not options.allow_reorder:
        return (*_ordered_dp(costs, step, list(range(p)), options), "exact")
    if (1 << p) * p * n * n // 2 <= SUBSET_DP_LIMIT:
        return (*_subset_dp(costs, step, options), "exact")
    # Too many stages for every order: which stage embeds and which runs the head are what order
    # changes most, so try every (first, last) pair with the others in the given order.
    best: tuple[float, int, list, list] | None = None
    for first in range(p):
        for last in range(p):
            if first == last and p > 1:
                continue
            middle = [i for i in range(p) if i not in (first, last)]
            order = [first] + middle + ([last] if last != first else [])
            chain, spans = _ordered_dp(costs, step, order, options, pinned_ends=True)
            if chain:
                value = max(costs.step_s(s, sp.start, sp.end) for s, sp in zip(chain, spans))
                key = (value, -len(chain))
                if best is None or key < best[:2]:
                    best = (value, -len(chain), chain, spans)
    search = (f"heuristic: {p} stages are too many to try every order; every (first, last) pair was tried "
              "with the others in the given order")
    return (best[2], best[3], search) if best else ([], [], search)


PAIR_DP_LIMIT = 2_500_000  # (subsets x first stages x spans) above which the link-aware search is a heuristic


def _search_over_links(costs: _CostModel, options: PlanOptions) -> tuple[list[StageProfile], list[LayerRange], str]:
    """The search with a link matrix: each stage's send priced by the link to its successor
    (planner.link_search); exact where the subsets are few, else stages grouped by host."""
    stages, n = costs.stages, costs.num_layers
    p = len(stages)
    inf = math.inf
    compute = [[[inf] * (n + 1) for _ in range(n + 1)] for _ in range(p)]
    for i, s in enumerate(stages):
        for start in range(n):
            for end in range(start + 1, n + 1):
                if costs.fits(s, start, end):
                    compute[i][start][end] = costs.compute_s(s, start, end)
    send = [[costs.mean_send_s(a, 0, b.name) if n > 0 else 0.0 for b in stages] for a in stages]
    if (1 << p) * p * n * n // 2 <= PAIR_DP_LIMIT:
        triples = pair_dp(compute, send, options.allow_drop, not options.allow_reorder, options.drop_tolerance)
        return [stages[i] for i, _, _ in triples], [LayerRange(a, b) for _, a, b in triples], "exact"
    orders = ([list(range(p))] if not options.allow_reorder
              else host_grouped_orders([costs.host_of(s) for s in stages], send))
    candidates = []
    for order in orders:
        # Every stage used, each sending to the next in this order: its sends are exact. With
        # dropping allowed, also each send priced at the slowest link to any later stage, so that
        # leaving one out never looks cheaper than it is. Both are priced exactly afterwards.
        runs = [(options if not options.allow_drop else replace(options, allow_drop=False), False)]
        if options.allow_drop:
            runs.append((options, True))
        for run_options, pessimistic in runs:
            step = [[[inf] * (n + 1) for _ in range(n + 1)] for _ in range(p)]
            for k, i in enumerate(order):
                later = order[k + 1:] if pessimistic else order[k + 1:k + 2]
                following = max((send[i][j] for j in later), default=0.0)
                for start in range(n):
                    for end in range(start + 1, n + 1):
                        if compute[i][start][end] < inf:
                            step[i][start][end] = compute[i][start][end] + (following if end < n else 0.0)
            chain, spans = _ordered_dp(costs, step, order, run_options)
            if chain:
                candidates.append((costs.estimate(chain, spans).step_s, chain, spans))
    search = (f"heuristic: {p} stages over {n} layers are too many to try every order on the link matrix; "
              "the stages of a host kept together, hosts chained by their fastest links, layers split exactly")
    if not candidates:
        return [], [], search
    _, chain, spans = _prefer_more_stages(candidates, lambda c: c[0], lambda c: len(c[1]), options.drop_tolerance)
    return chain, spans, search


def _subset_dp(costs: _CostModel, step, options: PlanOptions):
    """best[mask][e]: the smallest possible slowest-stage time placing layers [0, e) on exactly the
    stages in `mask`, in some order. Exact over every order and every subset of the stages."""
    stages, n = costs.stages, costs.num_layers
    p = len(stages)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(1 << p)]
    parent: list[list[tuple[int, int] | None]] = [[None] * (n + 1) for _ in range(1 << p)]
    best[0][0] = 0.0
    for mask in range(1, 1 << p):
        row, back = best[mask], parent[mask]
        for i in range(p):
            if not mask >> i & 1:
                continue
            prev = best[mask ^ (1 << i)]
            table = step[i]
            for start in range(n):
                before = prev[start]
                if before == inf:
                    continue
                costs_from = table[start]
                for end in range(start + 1, n + 1):
                    value = costs_from[end]
                    if value == inf:
                        continue
                    if before > value:
                        value = before
                    if value < row[end]:
                        row[end], back[end] = value, (i, start)
    masks = [m for m in range(1, 1 << p) if best[m][n] < inf]
    if not options.allow_drop:
        masks = [m for m in masks if m == (1 << p) - 1]
    if not masks:
        return [], []
    chosen = _prefer_more_stages(masks, lambda m: best[m][n], lambda m: bin(m).count("1"), options.drop_tolerance)
    chain, spans, mask, end = [], [], chosen, n
    while end > 0:
        i, start = parent[mask][end]
        chain.append(stages[i])
        spans.append(LayerRange(start, end))
        mask, end = mask ^ (1 << i), start
    return chain[::-1], spans[::-1]


def _ordered_dp(costs: _CostModel, step, order: list[int], options: PlanOptions, pinned_ends: bool = False):
    """Stages in a fixed order, each either used (>= 1 layer) or, with allow_drop, skipped.
    best[k][used][e]: smallest slowest-stage time with layers [0, e) on `used` of the first k stages."""
    stages, n = costs.stages, costs.num_layers
    p = len(order)
    inf = math.inf
    best = [[[inf] * (n + 1) for _ in range(p + 1)] for _ in range(p + 1)]
    parent = [[[None] * (n + 1) for _ in range(p + 1)] for _ in range(p + 1)]
    best[0][0][0] = 0.0
    for k in range(1, p + 1):
        i = order[k - 1]
        must_use = not options.allow_drop or (pinned_ends and (k == 1 or k == p))
        for used in range(0, k + 1):
            for end in range(n + 1):
                if not must_use and best[k - 1][used][end] < best[k][used][end]:
                    best[k][used][end], parent[k][used][end] = best[k - 1][used][end], ("skip", end)
                if used == 0 or end == 0:
                    continue
                for start in range(end):
                    before = best[k - 1][used - 1][start]
                    value = max(before, step[i][start][end])
                    if value < best[k][used][end]:
                        best[k][used][end], parent[k][used][end] = value, ("use", start)
    candidates = [used for used in range(1, p + 1) if best[p][used][n] < inf]
    if not candidates:
        return [], []
    used = _prefer_more_stages(candidates, lambda u: best[p][u][n], lambda u: u, options.drop_tolerance)
    chain, spans, end = [], [], n
    for k in range(p, 0, -1):
        action, start = parent[k][used][end]
        if action == "use":
            chain.append(stages[order[k - 1]])
            spans.append(LayerRange(start, end))
            used, end = used - 1, start
    return chain[::-1], spans[::-1]


def _too_small_message(costs: _CostModel) -> str:
    model, shapes = costs.model, costs.shapes
    n = model.num_layers
    p = len(costs.stages)
    # In the smallest format the stages may hold (under --weights auto: int4)
    fmt = min((costs.candidates(s)[-1] for s in costs.stages), key=lambda name: costs.weight_bytes(0, n, name))
    sizes = model.weights_in(fmt)
    weights = sum(sizes.layer_weight_bytes) + sizes.embed_bytes + sizes.head_bytes
    if p == 1 and model.head_shares_embed:
        weights -= sizes.embed_bytes
    kv = n * costs.kv_per_layer + (p - 1) * costs.sent_bytes
    workspace = costs.workspace_bytes(n) + (p - 1) * costs.workspace_bytes(0)
    need = weights + kv + workspace
    have = sum(s.memory_budget - costs.reserve_bytes(s) for s in costs.stages)
    prefixes = f" + {shapes.prefix_cache_tokens} prefix-cache tokens" if shapes.prefix_cache_tokens else ""
    detail = (f"the model needs {_gib(need)} (weights {_gib(weights)} in {sizes.name}, KV cache {_gib(kv)} for "
              f"{shapes.num_slots} slots x {shapes.max_context} tokens{prefixes}, workspace {_gib(workspace)}) and "
              f"the {p} stage(s) can hold {_gib(have)} after their reserves")
    if need > have:
        missing = need - have
        head = f"the cluster is {missing:,} bytes ({_gib(missing)}) short: {detail}"
    else:
        smallest = min(costs.stages, key=lambda s: s.memory_budget)
        head = (f"no contiguous split fits although the total would ({detail}); stage {smallest.name} "
                f"({_gib(smallest.memory_budget)}) cannot hold even one layer with its KV cache "
                f"({_gib(sizes.layer_weight_bytes[0] + costs.kv_per_layer)}) plus workspace")
    per_token = n * model.kv_bytes_per_token
    smaller = "" if fmt == "int4" else ", hold the weights in fewer bits (--weights auto, int8 or int4)"
    return (f"{head}. Ways out: add stages or memory (--memory-budget){smaller}, lower --max-context (KV costs "
            f"{per_token:,} bytes per slot-token over all layers), or fewer --slots / --micro-batch-size"
            + (" / --prefix-cache-tokens" if shapes.prefix_cache_tokens else ""))


def _gib(size: float) -> str:
    if abs(size) >= 1 << 30:
        return f"{size / (1 << 30):.2f} GiB"
    return f"{size / (1 << 20):.1f} MiB"
