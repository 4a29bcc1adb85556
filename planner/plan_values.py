"""The values placement reads and returns: each stage's profile, the model's memory needs, the
planner's options and shapes, and the plan (each stage's layers, memory and predicted time). Kept
apart from planner.placement, the planner itself, so each reads in one sitting."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from layerbus.planner.step_cost import LinearCost, StepWork
from layerbus.wire.spans import LayerRange


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
    device: str = "cpu"  # "cpu" stages on one host share its cores; GPU stages do not compete
    # Fitted from a profile at several shapes (planner.step_cost): what one layer and the per-step
    # overhead cost as a function of what a step carries. None (a cluster file, an older profile):
    # derived from the scalars above, proportional to rows and tokens.
    layer_cost: LinearCost | None = None
    overhead_cost: LinearCost | None = None
    head_step_s: float = 0.0  # the part of head_s that is fixed per step emitting tokens (the rest is per row)
    head_rows: int = 0  # rows head_s was measured at (0: micro_batch_size)
    host: str = ""  # the machine it runs on ("" = unknown: shares nothing)
    host_cores: int = 0  # cores that machine gives its processes (0 = unknown)
    threads: int = 0  # torch threads of this stage
    compute_share: float = 1.0  # share of its busy time spent computing (an emulated slower device sleeps the rest)
    # Measured: its step's time with the other stages of its host serving at once / alone (0 = not
    # measured: the stretch is then reckoned from threads and cores)
    corun_factor: float = 0.0
    # Measured on its host: seconds a step of the host's stages lasts longer when they start each step
    # together (as a ring of one micro-batch per stage does) than the slowest at its own pace (0 = not
    # measured, or none). Broker.profile's probe in step, broker.profiling.lockstep_excess_s.
    lockstep_excess_s: float = 0.0
    # What came out of a --memory-budget before memory_budget (stages/memory_budget.py memory_figures): the
    # stage's runtime and its loader's temporary; shown by `plan --explain`, not planned with.
    runtime_bytes: int = 0
    loader_bytes: int = 0
    # The --weights it holds its layers in (wire.weight_formats): its own flag, else the broker's. "auto"
    # lets the planner choose per stage (planner.weight_choice): full precision where it fits, else int8, int4.
    weights: str = "auto"
    # The format the profile was timed in (a stage's --weights; "auto": full precision), and under auto
    # one decoder layer's cost in each quantized format it may fall back to, measured beside full
    # precision (broker.profiling.format_layer_costs). A format not listed is priced as `layer`.
    weights_profiled: str = "auto"
    format_layer_costs: tuple[tuple[str, LinearCost], ...] = ()

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
        if not 0 < self.compute_share <= 1:
            raise ValueError(f"stage {self.name!r}: compute_share must be in (0, 1], got {self.compute_share}")

    @property
    def layer(self) -> LinearCost:
        """One decoder layer's cost of a step."""
        if self.layer_cost is not None:
            return self.layer_cost
        return LinearCost(per_row_s=self.layer_decode_s / self.micro_batch_size,
                          per_token_s=self.layer_prefill_s / self.prefill_tokens)

    def layer_in(self, weights: str | None) -> LinearCost:
        """One decoder layer's cost held in `weights` (None or a format not timed: as profiled)."""
        for name, cost in self.format_layer_costs:
            if name == weights:
                return cost
        return self.layer

    def format_speed(self, weights: str | None) -> float | None:
        """A layer's decode step in `weights` over as profiled (None: not timed apart), for the plan's text."""
        if weights is None or not any(name == weights for name, _ in self.format_layer_costs):
            return None
        rows = self.micro_batch_size  # a decode step at 256 cached positions, as the profiles time it
        work = StepWork(steps=1, passes=1, decode_rows=rows, decode_kv=rows * 257)
        base = self.layer.of(work)
        return self.layer_in(weights).of(work) / base if base > 0 else None

    @property
    def overhead(self) -> LinearCost:
        """The step's cost whatever the layers (rotary tables, masks, Python)."""
        if self.overhead_cost is not None:
            return self.overhead_cost
        return LinearCost(per_step_s=self.step_overhead_s)

    @property
    def embed_token_s(self) -> float:
        return self.embed_s / self.micro_batch_size

    @property
    def head_row_s(self) -> float:
        return max(0.0, self.head_s - self.head_step_s) / (self.head_rows or self.micro_batch_size)

    def busy_s(self, work: StepWork, num_layers: int, is_first: bool, is_last: bool,
               weights: str | None = None) -> float:
        """Seconds this stage computes for `work` holding `num_layers` layers (and the ends it holds) in
        format `weights` (None: the one it was profiled in)."""
        time = self.overhead.of(work) + num_layers * self.layer_in(weights).of(work)
        if is_first:
            time += self.embed_token_s * work.positions
        if is_last:
            time += self.head_step_s * work.emit_steps + self.head_row_s * work.emit_rows
        return time

    @property
    def shares_cores(self) -> bool:
        """A CPU stage on a known host: it competes for that host's cores with the others there."""
        return bool(self.host) and self.host_cores > 0 and self.device.split(":")[0] == "cpu"

    def slowed(self, factor: float) -> "StageProfile":
        """The same stage running `factor` times slower (links unchanged)."""
        from dataclasses import replace

        return replace(self, layer_decode_s=self.layer_decode_s * factor, layer_prefill_s=self.layer_prefill_s * factor,
                       embed_s=self.embed_s * factor, head_s=self.head_s * factor,
                       step_overhead_s=self.step_overhead_s * factor, head_step_s=self.head_step_s * factor,
                       layer_cost=self.layer_cost.scaled(factor) if self.layer_cost else None,
                       overhead_cost=self.overhead_cost.scaled(factor) if self.overhead_cost else None)


@dataclass(frozen=True)
class FormatWeights:
    """The model's weights in one --weights format, exact from the headers (models.weight_sizes)."""

    name: str  # "fp32", "bf16", "fp16", "int8", "int4" or "native"
    layer_weight_bytes: tuple[int, ...]  # each decoder layer
    embed_bytes: int  # the token embedding (first stage)
    head_bytes: int  # final norm + LM head; a tied head counts the embedding matrix again


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
    # The weights in each format a stage may hold them in (empty: only the fields above, in the dtype)
    formats: tuple[FormatWeights, ...] = ()
    full_format: str = "fp32"  # the --weights name of the stages' dtype: what the fields above are in

    @property
    def num_layers(self) -> int:
        return len(self.layer_weight_bytes)

    def weights_in(self, name: str) -> FormatWeights:
        """The weights in format `name`; the full-precision format is the fields above."""
        for known in self.formats:
            if known.name == name:
                return known
        if name in (self.full_format, "auto"):
            return FormatWeights(self.full_format, self.layer_weight_bytes, self.embed_bytes, self.head_bytes)
        raise ValueError(f"no weight sizes for format {name!r}: the model's memory was sized for "
                         f"{[self.full_format] + [f.name for f in self.formats]}")

    def workspace_bytes(self, step_tokens: int, rows: int, max_context: int, is_last: bool) -> int:
        """Activation temporaries of one step (an approximation: docs/placement.md, the memory a stage counts): a
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
    # Under --weights auto, how far down int8, int4 a plan may go (planner.weight_choice.AUTO_FALLBACKS; 0:
    # full precision only). The broker lowers it to the first placement's level for its re-plans: a job
    # whose stages held full precision must not switch to int8 after a lost stage, which would change the
    # outputs of the items still to come; it waits for a stage to join instead.
    max_auto_level: int = 2
    reserve_fraction: float = 0.05  # of each budget kept free (allocator slack, fragmentation, the runtime)
    allow_reorder: bool = True  # choose the order of the stages (else: as given)
    allow_drop: bool = True  # leave out stages that would only slow the chain
    # Use fewer stages only when that is this much faster: profiles are noisy (a busy host, a tiny
    # model whose steps are mostly fixed cost), and a stage left out for noise is a stage wasted.
    drop_tolerance: float = 0.2
    # Keep the stages in the order given (by name, for local stages) unless another order is predicted
    # this much faster: identical stages whose profiles differ by timing noise were chained
    # stage-3 -> stage-2 -> stage-1 -> stage-0, and a chain should read in its names' order.
    reorder_tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not self.prompt_tokens_per_new_token >= 0:
            raise ValueError(f"prompt_tokens_per_new_token must be >= 0, got {self.prompt_tokens_per_new_token}")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if not self.drop_tolerance >= 0:
            raise ValueError(f"drop_tolerance must be >= 0, got {self.drop_tolerance}")
        if not self.reorder_tolerance >= 0:
            raise ValueError(f"reorder_tolerance must be >= 0, got {self.reorder_tolerance}")


@dataclass(frozen=True)
class Shapes:
    """The batching figures the plan depends on (from a resolved BatchingConfig)."""

    num_slots: int  # sequences in flight: every stage holds KV for all of them
    micro_batch_size: int  # decode rows per step
    num_micro_batches: int  # steps in flight at once
    max_context: int  # KV positions per slot
    max_step_tokens: int  # tokens one step may carry (the prefill chunk)
    prefix_cache_tokens: int = 0  # KV positions every stage keeps for shared prefixes (broker/prefix_cache.py)
    keep_sent: bool = True  # every stage but the last keeps what it sends, per position (BatchingConfig.keep_caches)

    @classmethod
    def from_batching(cls, batching, num_stages: int) -> "Shapes":
        resolved = batching if batching.num_slots and batching.num_micro_batches else batching.resolved(num_stages)
        from layerbus.planner.prefix_budget import prefix_positions

        return cls(resolved.num_slots, resolved.micro_batch_size, resolved.num_micro_batches,
                   resolved.max_context, resolved.max_step_tokens,
                   prefix_positions(resolved.prefix_cache, resolved.num_slots, resolved.max_context),
                   resolved.keep_caches)

    @property
    def kv_positions(self) -> int:
        """KV positions a stage holds per layer: every slot's whole context, plus the prefix cache's."""
        return self.num_slots * self.max_context + self.prefix_cache_tokens


@dataclass(frozen=True)
class StagePlacement:
    """One stage of a plan: its layers, its memory and its predicted time per step."""

    name: str
    layers: LayerRange
    is_first: bool
    is_last: bool
    memory_budget: int
    weight_bytes: int  # its layers, plus the embedding (first) and the norm + head (last)
    kv_bytes: int  # KV of its layers for all slots at the full context, plus what it keeps of what it sends on
    workspace_bytes: int
    reserve_bytes: int
    compute_s: float  # per step (mean over the job): layers + embedding + head + fixed overhead, stretched by sharing
    send_s: float  # per step (mean): activations over its link (0 on the last stage)
    latency_s: float  # its link's latency (counts in the round trip, not in the pace)
    layer_s: float  # one more layer would add this much per step
    layer_bytes: int  # one more layer would need this many bytes (weights + KV)
    alone_s: float | None = None  # per step as if it had its host to itself (None: as step_s)
    host: str = ""  # the machine it runs on ("" unknown)
    link_bandwidth: float = math.inf  # bytes/s of the link it sends on (to the next stage; the last: the broker)
    weights: str = "fp32"  # the format it holds its weights in (chosen by the planner under --weights auto)
    requested_weights: str = "auto"  # what it was asked to hold (its own --weights, else the broker's)
    # Its layers' decode step in `weights` over full precision's, as the stage measured it under --weights
    # auto (None: not timed apart: profiled in that format, or priced as full precision)
    format_speed: float | None = None
    # Under --weights auto in full precision: a quantized format its stage measured clearly faster (below
    # FASTER_FORMAT), and that speed; auto keeps full precision (quality first), `plan --explain` says it
    faster_format: tuple[str, float] | None = None

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
    step_s: float  # the slowest stage's busy time per step (mean over the job)
    round_trip_s: float  # one step through every stage and link, back to the broker
    tokens_per_s: float  # new tokens per second over the job
    bubble: float  # share of the stages' time spent waiting (for the slowest one, for a phase to pass)
    job_s: float = 0.0  # seconds the job (or, without one, one step per micro-batch) takes
    new_tokens: float = 0.0  # new tokens in that time
    steps: float = 0.0  # steps sent in that time

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
                "tokens_per_s": self.tokens_per_s, "bubble": self.bubble, "fits": self.fits, "job_s": self.job_s,
                "new_tokens": self.new_tokens, "steps": self.steps,
                "stages": [{"name": s.name, "layers": s.layers.to_json(), "num_layers": len(s.layers),
                            "embed": s.is_first, "head": s.is_last, "weights": s.weights,
                            "weights_speed_vs_full": s.format_speed, "step_ms": 1000 * s.step_s,
                            "compute_ms": 1000 * s.compute_s, "send_ms": 1000 * s.send_s,
                            "memory_budget": s.memory_budget, "weight_bytes": s.weight_bytes,
                            "kv_bytes": s.kv_bytes, "workspace_bytes": s.workspace_bytes,
                            "reserve_bytes": s.reserve_bytes, "free_bytes": s.free_bytes, "host": s.host,
                            "link_bandwidth": s.link_bandwidth if math.isfinite(s.link_bandwidth) else None,
                            "link_latency_ms": 1000 * s.latency_s}
                           for s in self.stages]}


@dataclass(frozen=True)
class Plan:
    """The chosen placement, the stages left out, and the equal split's figures for comparison."""

    chosen: SplitEstimate
    left_out: tuple[str, ...]  # stages given no layers: they would only slow the chain
    equal: SplitEstimate | None  # equal layer counts over all stages in the given order (None: more stages than layers)
    shapes: Shapes
    options: PlanOptions = field(default_factory=PlanOptions)
    job: object = None  # the job's windows it was planned for (planner.workload.JobShape; None: a steady mix)
    network: object = None  # the link matrix it was planned on (planner.network.LinkMatrix; None: each stage's own link)
    search: str = "exact"  # how the order was found: "exact", or the heuristic used, in words
    # With a network: the chain the planner would choose ignoring it (each stage's own link), priced on it
    blind: SplitEstimate | None = None

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
    def chosen_work(self) -> StepWork:
        """What the job's steps carry in all (without a job: one steady step per micro-batch)."""
        if self.job is not None:
            return self.job.total
        from layerbus.planner.workload import steady_shape

        s = self.shapes
        return steady_shape(s.micro_batch_size, s.num_micro_batches, self.options.prompt_tokens_per_new_token,
                            min(256, s.max_context // 2), s.max_step_tokens).total

    @property
    def predicted_step_s(self) -> dict[str, float]:
        """Stage name -> predicted seconds per step (to tell a stage that has slowed down)."""
        return {stage.name: stage.step_s for stage in self.chosen.stages}

    def to_json(self) -> dict:
        return {"chosen": self.chosen.to_json(), "left_out": list(self.left_out),
                "equal": self.equal.to_json() if self.equal else None,
                "shapes": vars(self.shapes), "prompt_tokens_per_new_token": self.options.prompt_tokens_per_new_token,
                "search": self.search, "ignoring_network": self.blind.to_json() if self.blind else None}
