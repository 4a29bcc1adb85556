"""Placing a model's layers on mismatched stages: which stages, in which order, which layers each.

A pure function over each stage's measured (or described) profile and the model's exact memory
needs. A pipeline with more micro-batches than stages runs at the pace of its slowest stage, so
the plan minimizes the slowest stage's time per pipeline step: its layers, the embedding on the
first stage, the LM head on the last, plus sending its activations on. Each stage must hold its
weights, the KV cache of its layers for every slot at the full context length, an activation
workspace and a reserve within its memory budget. It is solved exactly by dynamic programming
over (stages used, layers placed), which also picks the order of the stages (where the head and
the embedding go matters) and leaves out a stage that would only slow the chain.

A pipeline step here is what yields one new token per slot of a micro-batch: `micro_batch_size`
decode rows plus the prompt tokens the workload brings along per generated token
(`PlanOptions.prompt_tokens_per_new_token`), so predicted tokens/s count new tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from layerbus.broker.partition import equal_partition
from layerbus.wire.spans import LayerRange

SUBSET_DP_LIMIT = 6_000_000  # inner-loop steps above which the order search falls back to (first, last) pairs


class PlacementError(ValueError):
    """No placement fits: says how many bytes are missing and the way out."""


@dataclass(frozen=True)
class StageProfile:
    """What one stage can do, measured on its own device, dtype and threads (or described in a file)."""

    name: str
    layer_decode_s: float  # one decoder layer, one decode step of `micro_batch_size` rows
    layer_prefill_s: float  # one decoder layer, one prefill chunk of `prefill_tokens` tokens
    embed_s: float  # the token embedding for one decode step (first stage only)
    head_s: float  # final norm + LM head + log-softmax for one decode step (last stage only)
    memory_budget: int  # bytes this stage may fill: free device memory, or its --memory-budget
    link_bandwidth: float = math.inf  # bytes/s at which this stage sends activations on
    link_latency_s: float = 0.0  # one-way latency of that link
    step_overhead_s: float = 0.0  # fixed cost per step whatever the layers (rotary, masks, Python)
    micro_batch_size: int = 32  # decode rows the decode times were measured at
    prefill_tokens: int = 256  # tokens of the measured prefill chunk
    device: str = "cpu"  # for display

    def __post_init__(self) -> None:
        for name in ("layer_decode_s", "layer_prefill_s", "embed_s", "head_s", "link_latency_s", "step_overhead_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"stage {self.name!r}: {name} must be a finite number >= 0, got {value}")
        if not self.link_bandwidth > 0:
            raise ValueError(f"stage {self.name!r}: link_bandwidth must be > 0 bytes/s, got {self.link_bandwidth}")
        if self.memory_budget < 0:
            raise ValueError(f"stage {self.name!r}: memory_budget must be >= 0 bytes, got {self.memory_budget}")
        if self.micro_batch_size < 1 or self.prefill_tokens < 1:
            raise ValueError(f"stage {self.name!r}: micro_batch_size and prefill_tokens must be >= 1")


@dataclass(frozen=True)
class ModelMemory:
    """The model's memory needs in the stages' dtype, exact from the safetensors headers."""

    layer_weight_bytes: tuple[int, ...]  # weights of each decoder layer
    embed_bytes: int  # the token embedding (first stage)
    head_bytes: int  # final norm + LM head (last stage); tied heads count the embedding matrix again
    head_shares_embed: bool  # tied: a stage holding both ends stores the matrix once
    kv_bytes_per_token: int  # keys + values of one layer for one slot-token: 2 x kv_heads x head_dim x dtype
    activation_bytes_per_token: int  # one position's hidden state as it travels: hidden x dtype
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    dtype_bytes: int  # bytes per element of the stages' dtype

    @property
    def num_layers(self) -> int:
        return len(self.layer_weight_bytes)

    def workspace_bytes(self, step_tokens: int, rows: int, max_context: int, is_last: bool) -> int:
        """Activation temporaries of one step (an approximation, documented in the README): a
        prefill chunk's MLP and attention activations, its attention scores over the full context
        (float32), and on the last stage the float32 logits, log-softmax and probabilities."""
        layer = step_tokens * (4 * self.hidden_size + 3 * self.intermediate_size) * self.dtype_bytes
        scores = self.num_attention_heads * step_tokens * max_context * 4
        logits = 3 * rows * self.vocab_size * 4 if is_last else 0
        return layer + scores + logits


@dataclass(frozen=True)
class PlanOptions:
    """Choices the planner does not measure."""

    prompt_tokens_per_new_token: float = 1.0  # workload mix: prompt tokens prefilled per generated token
    reserve_fraction: float = 0.05  # of each budget kept free (allocator slack, fragmentation, the runtime)
    allow_reorder: bool = True  # choose the order of the stages (else: as given)
    allow_drop: bool = True  # leave out stages that would only slow the chain
    # Use fewer stages only when that is this much faster: profiles are noisy (a busy host, a tiny
    # model whose steps are mostly fixed cost), and a stage left out for noise is a stage wasted.
    drop_tolerance: float = 0.2

    def __post_init__(self) -> None:
        if not self.prompt_tokens_per_new_token >= 0:
            raise ValueError(f"prompt_tokens_per_new_token must be >= 0, got {self.prompt_tokens_per_new_token}")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if not self.drop_tolerance >= 0:
            raise ValueError(f"drop_tolerance must be >= 0, got {self.drop_tolerance}")


@dataclass(frozen=True)
class Shapes:
    """The batching figures the plan depends on (from a resolved BatchingConfig)."""

    num_slots: int  # sequences in flight: every stage holds KV for all of them
    micro_batch_size: int  # decode rows per step
    num_micro_batches: int  # steps in flight at once
    max_context: int  # KV positions per slot
    max_step_tokens: int  # tokens one step may carry (the prefill chunk)

    @classmethod
    def from_batching(cls, batching, num_stages: int) -> "Shapes":
        resolved = batching if batching.num_slots and batching.num_micro_batches else batching.resolved(num_stages)
        return cls(resolved.num_slots, resolved.micro_batch_size, resolved.num_micro_batches,
                   resolved.max_context, resolved.max_step_tokens)


@dataclass(frozen=True)
class StagePlacement:
    """One stage of a plan: its layers, its memory and its predicted time per step."""

    name: str
    layers: LayerRange
    is_first: bool
    is_last: bool
    memory_budget: int
    weight_bytes: int  # its layers, plus the embedding (first) and the norm + head (last)
    kv_bytes: int  # KV of its layers for all slots at the full context
    workspace_bytes: int
    reserve_bytes: int
    compute_s: float  # per step: layers + embedding + head + fixed overhead
    send_s: float  # per step: activations over its link (0 on the last stage)
    latency_s: float  # its link's latency (counts in the round trip, not in the pace)
    layer_s: float  # one more layer would add this much per step
    layer_bytes: int  # one more layer would need this many bytes (weights + KV)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.send_s

    @property
    def used_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.workspace_bytes + self.reserve_bytes

    @property
    def free_bytes(self) -> int:
        return self.memory_budget - self.used_bytes

    @property
    def fits(self) -> bool:
        return self.free_bytes >= 0


@dataclass(frozen=True)
class SplitEstimate:
    """A chain of stages with their layers, and what it should do."""

    stages: tuple[StagePlacement, ...]  # in chain order
    step_s: float  # the slowest stage's time per step: the pipeline's pace
    round_trip_s: float  # one step through every stage and link, back to the broker
    tokens_per_s: float  # new tokens per second
    bubble: float  # share of the stages' time spent waiting for the slowest one

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.stages)

    @property
    def spans(self) -> list[LayerRange]:
        return [stage.layers for stage in self.stages]

    @property
    def order(self) -> list[str]:
        return [stage.name for stage in self.stages]

    def to_json(self) -> dict:
        return {"step_ms": 1000 * self.step_s, "round_trip_ms": 1000 * self.round_trip_s,
                "tokens_per_s": self.tokens_per_s, "bubble": self.bubble, "fits": self.fits,
                "stages": [{"name": s.name, "layers": s.layers.to_json(), "num_layers": len(s.layers),
                            "embed": s.is_first, "head": s.is_last, "step_ms": 1000 * s.step_s,
                            "compute_ms": 1000 * s.compute_s, "send_ms": 1000 * s.send_s,
                            "memory_budget": s.memory_budget, "weight_bytes": s.weight_bytes,
                            "kv_bytes": s.kv_bytes, "workspace_bytes": s.workspace_bytes,
                            "reserve_bytes": s.reserve_bytes, "free_bytes": s.free_bytes}
                           for s in self.stages]}


@dataclass(frozen=True)
class Plan:
    """The chosen placement, the stages left out, and the equal split's figures for comparison."""

    chosen: SplitEstimate
    left_out: tuple[str, ...]  # stages given no layers: they would only slow the chain
    equal: SplitEstimate | None  # equal layer counts over all stages in the given order (None: more stages than layers)
    shapes: Shapes
    options: PlanOptions = field(default_factory=PlanOptions)

    @property
    def stages(self) -> tuple[StagePlacement, ...]:
        return self.chosen.stages

    @property
    def order(self) -> list[str]:
        return self.chosen.order

    @property
    def spans(self) -> list[LayerRange]:
        return self.chosen.spans

    @property
    def step_s(self) -> float:
        return self.chosen.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.chosen.tokens_per_s

    @property
    def bubble(self) -> float:
        return self.chosen.bubble

    @property
    def predicted_step_s(self) -> dict[str, float]:
        """Stage name -> predicted seconds per step (to tell a stage that has slowed down)."""
        return {stage.name: stage.step_s for stage in self.chosen.stages}

    def to_json(self) -> dict:
        return {"chosen": self.chosen.to_json(), "left_out": list(self.left_out),
                "equal": self.equal.to_json() if self.equal else None,
                "shapes": vars(self.shapes), "prompt_tokens_per_new_token": self.options.prompt_tokens_per_new_token}


# -- the cost model ---------------------------------------------------------------------------------

class _CostModel:
    """Per-stage time and memory of holding layers [start, end), as the DP and the estimates see them."""

    def __init__(self, stages: Sequence[StageProfile], model: ModelMemory, shapes: Shapes, options: PlanOptions):
        self.stages, self.model, self.shapes, self.options = list(stages), model, shapes, options
        n = model.num_layers
        self.weight_prefix = [0]
        for size in model.layer_weight_bytes:
            self.weight_prefix.append(self.weight_prefix[-1] + size)
        rows = shapes.micro_batch_size
        self.prefill_per_step = options.prompt_tokens_per_new_token * rows
        self.kv_per_layer = model.kv_bytes_per_token * shapes.num_slots * shapes.max_context
        self.num_layers = n

    def layer_s(self, s: StageProfile) -> float:
        rows = self.shapes.micro_batch_size
        return (s.layer_decode_s * rows / s.micro_batch_size
                + s.layer_prefill_s * self.prefill_per_step / s.prefill_tokens)

    def compute_s(self, s: StageProfile, start: int, end: int) -> float:
        rows = self.shapes.micro_batch_size
        first, last = start == 0, end == self.num_layers
        time = s.step_overhead_s + (end - start) * self.layer_s(s)
        if first:
            time += s.embed_s * (rows + self.prefill_per_step) / s.micro_batch_size
        if last:
            time += s.head_s * rows / s.micro_batch_size
        return time

    def send_s(self, s: StageProfile, end: int) -> float:
        if end == self.num_layers:
            return 0.0  # the last stage returns a few token ids
        size = (self.shapes.micro_batch_size + self.prefill_per_step) * self.model.activation_bytes_per_token
        return size / s.link_bandwidth

    def step_s(self, s: StageProfile, start: int, end: int) -> float:
        return self.compute_s(s, start, end) + self.send_s(s, end)

    def weight_bytes(self, start: int, end: int) -> int:
        first, last = start == 0, end == self.num_layers
        size = self.weight_prefix[end] - self.weight_prefix[start]
        if first:
            size += self.model.embed_bytes
        if last:
            size += self.model.head_bytes - (self.model.embed_bytes if first and self.model.head_shares_embed else 0)
        return size

    def workspace_bytes(self, end: int) -> int:
        return self.model.workspace_bytes(self.shapes.max_step_tokens, self.shapes.micro_batch_size,
                                          self.shapes.max_context, end == self.num_layers)

    def reserve_bytes(self, s: StageProfile) -> int:
        return int(s.memory_budget * self.options.reserve_fraction)

    def fits(self, s: StageProfile, start: int, end: int) -> bool:
        need = (self.weight_bytes(start, end) + (end - start) * self.kv_per_layer + self.workspace_bytes(end)
                + self.reserve_bytes(s))
        return need <= s.memory_budget

    def placement(self, s: StageProfile, start: int, end: int) -> StagePlacement:
        return StagePlacement(
            name=s.name, layers=LayerRange(start, end), is_first=start == 0, is_last=end == self.num_layers,
            memory_budget=s.memory_budget, weight_bytes=self.weight_bytes(start, end),
            kv_bytes=(end - start) * self.kv_per_layer, workspace_bytes=self.workspace_bytes(end),
            reserve_bytes=self.reserve_bytes(s), compute_s=self.compute_s(s, start, end),
            send_s=self.send_s(s, end), latency_s=s.link_latency_s, layer_s=self.layer_s(s),
            layer_bytes=(self.model.layer_weight_bytes[min(end, self.num_layers - 1)] + self.kv_per_layer))

    def estimate(self, chain: Sequence[StageProfile], spans: Sequence[LayerRange]) -> SplitEstimate:
        placements = tuple(self.placement(s, span.start, span.end) for s, span in zip(chain, spans))
        return summarize(placements, self.shapes)


def summarize(placements: tuple[StagePlacement, ...], shapes: Shapes) -> SplitEstimate:
    """Pace, round trip, tokens/s and bubble of a chain. With m micro-batches in flight the chain
    runs at its slowest stage's pace unless one step's round trip exceeds m of those."""
    step = max(p.step_s for p in placements)
    round_trip = sum(p.step_s + p.latency_s for p in placements)
    cycle = max(step, round_trip / max(1, shapes.num_micro_batches))
    tokens = shapes.micro_batch_size / cycle if cycle > 0 else math.inf
    bubble = 1.0 - sum(p.step_s for p in placements) / (len(placements) * cycle) if cycle > 0 else 0.0
    return SplitEstimate(placements, step, round_trip, tokens, bubble)


# -- the planner ------------------------------------------------------------------------------------

def plan_placement(stages: Sequence[StageProfile], model: ModelMemory, batching,
                   options: PlanOptions = PlanOptions()) -> Plan:
    """The placement minimizing the slowest stage's time per step within every stage's memory.

    `stages` is any set of profiles (their order is the chain order when `allow_reorder` is off,
    and the equal split's order); `batching` is a BatchingConfig (resolved for len(stages) if it is
    not). Raises PlacementError when no placement fits."""
    if not stages:
        raise PlacementError("no stages to place the model on: start at least one stage")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise PlacementError(f"stage names must be unique, got {names}")
    shapes = batching if isinstance(batching, Shapes) else Shapes.from_batching(batching, len(stages))
    costs = _CostModel(stages, model, shapes, options)
    chain, spans = _search(costs, options)
    if not chain:
        raise PlacementError(_too_small_message(costs))
    chosen = costs.estimate(chain, spans)
    used = {s.name for s in chain}
    equal = None
    if len(stages) <= model.num_layers:
        equal = costs.estimate(stages, equal_partition(model.num_layers, len(stages)))
    return Plan(chosen, tuple(n for n in names if n not in used), equal, shapes, options)


def estimate_split(stages: Sequence[StageProfile], spans: Sequence[LayerRange], model: ModelMemory, batching,
                   options: PlanOptions = PlanOptions()) -> SplitEstimate:
    """The figures of a given chain and split (an equal split, a split in use) under the same model."""
    if len(stages) != len(spans):
        raise ValueError(f"{len(stages)} stages but {len(spans)} spans")
    shapes = batching if isinstance(batching, Shapes) else Shapes.from_batching(batching, len(stages))
    return _CostModel(stages, model, shapes, options).estimate(stages, spans)


def _search(costs: _CostModel, options: PlanOptions) -> tuple[list[StageProfile], list[LayerRange]]:
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
        return _ordered_dp(costs, step, list(range(p)), options)
    if (1 << p) * p * n * n // 2 <= SUBSET_DP_LIMIT:
        return _subset_dp(costs, step, options)
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
    return (best[2], best[3]) if best else ([], [])


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


def _prefer_more_stages(candidates, value, size, tolerance: float):
    """The candidate with the most stages among those within `tolerance` of the fastest; a stage
    is left out only when that is clearly faster, since more stages also means more memory headroom."""
    fastest = min(value(c) for c in candidates)
    close = [c for c in candidates if value(c) <= fastest * (1 + tolerance) + 1e-15]
    return min(close, key=lambda c: (-size(c), value(c)))


def _too_small_message(costs: _CostModel) -> str:
    model, shapes = costs.model, costs.shapes
    n = model.num_layers
    p = len(costs.stages)
    weights = sum(model.layer_weight_bytes) + model.embed_bytes + model.head_bytes
    if p == 1 and model.head_shares_embed:
        weights -= model.embed_bytes
    kv = n * costs.kv_per_layer
    workspace = costs.workspace_bytes(n) + (p - 1) * costs.workspace_bytes(0)
    need = weights + kv + workspace
    have = sum(s.memory_budget - costs.reserve_bytes(s) for s in costs.stages)
    detail = (f"the model needs {_gib(need)} (weights {_gib(weights)}, KV cache {_gib(kv)} for "
              f"{shapes.num_slots} slots x {shapes.max_context} tokens, workspace {_gib(workspace)}) and "
              f"the {p} stage(s) can hold {_gib(have)} after their reserves")
    if need > have:
        missing = need - have
        head = f"the cluster is {missing:,} bytes ({_gib(missing)}) short: {detail}"
    else:
        smallest = min(costs.stages, key=lambda s: s.memory_budget)
        head = (f"no contiguous split fits although the total would ({detail}); stage {smallest.name} "
                f"({_gib(smallest.memory_budget)}) cannot hold even one layer with its KV cache "
                f"({_gib(model.layer_weight_bytes[0] + costs.kv_per_layer)}) plus workspace")
    per_token = n * model.kv_bytes_per_token
    return (f"{head}. Ways out: add stages or memory (--memory-budget), lower --max-context (KV costs "
            f"{per_token:,} bytes per slot-token over all layers), or fewer --slots / --micro-batch-size")


def _gib(size: float) -> str:
    if abs(size) >= 1 << 30:
        return f"{size / (1 << 30):.2f} GiB"
    return f"{size / (1 << 20):.1f} MiB"
