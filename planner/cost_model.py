"""The planner's cost model: the time and memory of a stage holding layers [start, end), and the
figures of a whole chain and split (`CostModel.estimate`). The searches (planner.chain_search) balance
its per-step times; a job's windows are priced with planner.window_pricing.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from layerbus.planner.network import BROKER, Link, LinkMatrix
from layerbus.planner.plan_values import ModelMemory, PlanOptions, Shapes, SplitEstimate, StagePlacement, StageProfile
from layerbus.planner.step_cost import StepWork
from layerbus.planner.weight_choice import AUTO_FALLBACKS, first_that_fits, weight_candidates
from layerbus.planner.window_pricing import Neighbours, window_floor_s, window_s
from layerbus.planner.workload import JobShape, Window, steady_shape
from layerbus.wire.spans import LayerRange

# A quantized format measured at most this share of full precision's time is worth a line in `plan
# --explain` (clearly faster than the ratio's noise of a few percent)
FASTER_FORMAT = 0.8


class CostModel:
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

