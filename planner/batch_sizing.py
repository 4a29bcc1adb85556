"""Choosing the batch sizes the user left to us (0 = auto) from the stages' profiles, their memory and
the job: pure, table-tested.

A decode step costs a fixed part (reading every weight once, Python per step) plus a part per row,
so a row's cost falls with the rows of a micro-batch towards the per-row cost alone. The micro-batch
is the smallest whose cost per row is within `tolerance` of that asymptote on every stage (more rows
gain little and cost KV memory and a longer drain at the end of a job), capped by memory (every slot
holds its KV cache at the full context on every stage). A job of known size gets a slot per item
up to that cap: a job that does not fill its slots evenly ends in a tail of steps carrying few rows.
The prefill budget per step follows the same rule for prompt tokens: the smallest chunk whose cost
per token is within `tolerance` of the per-token cost, plus room for the decode rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from layerbus.planner.plan_values import ModelMemory, StageProfile
from layerbus.planner.prefix_budget import MAX_SHARE_OF_SLOTS
from layerbus.planner.batching import default_micro_batches
from layerbus.planner.step_cost import StepWork, prefill_context
from layerbus.planner.weight_choice import AUTO_FALLBACKS, weight_candidates

DEFAULT_MICRO_BATCH = 32  # without profiles (partition equal or balanced) and without a user's value
DEFAULT_STEP_TOKENS = 256
MAX_MICRO_BATCH = 256
MIN_STEP_TOKENS, MAX_STEP_TOKENS = 64, 2048


@dataclass(frozen=True)
class Sizing:
    """The chosen sizes (a resolved BatchingConfig) and one line per choice saying why."""

    batching: object  # broker.scheduler.BatchingConfig, resolved
    reasons: tuple[str, ...]


def choose_batching(requested, num_stages: int, profiles: Sequence[StageProfile], memory: ModelMemory | None,
                    items: int | None = None, mean_context: float | None = None,
                    tolerance: float = 0.15, reserve_fraction: float = 0.05) -> Sizing:
    """`requested`: a BatchingConfig whose micro_batch_size, num_micro_batches, num_slots and
    max_step_tokens are the user's where non-zero, auto where 0. `items`: the job's item count
    (None: unknown); `mean_context`: the mean positions a decode row attends over (None: a quarter
    of max_context). Values the user gave are kept as given."""
    reasons = []
    micro_batches = requested.num_micro_batches or default_micro_batches(num_stages)
    if not requested.num_micro_batches:
        reasons.append(f"micro-batches {micro_batches}: one per stage plus one, so every stage has one while "
                       "the broker plans the next" if num_stages > 1 else
                       "micro-batches 1: a single stage waits only the broker's few milliseconds between steps")
    if requested.num_slots:  # the user's slots decide the micro-batch size
        resolved = requested.resolved(num_stages)
        size = resolved.micro_batch_size
        reasons.append(f"slots {resolved.num_slots}: as given (micro-batches of {size})")
    else:
        size, why = _micro_batch_size(requested, profiles, memory, micro_batches, items, mean_context, tolerance,
                                      reserve_fraction)
        reasons.append(why)
    chunk = requested.max_step_tokens
    if not chunk:
        chunk, why = _step_tokens(profiles, size, requested.max_context, tolerance)
        reasons.append(why)
        if memory is not None and profiles and not (requested.micro_batch_size or requested.num_slots):
            # The size was checked against memory at the default prefill budget; a larger chunk's attention
            # scores over the whole context take more, and the planner would refuse the sizes.
            prefixes = requested.prefix_cache
            most = fitting_slots(profiles, memory, requested.max_context, chunk, reserve_fraction,
                                 prefixes.budget_tokens if prefixes.enabled else 0, micro_batches,
                                 requested.keep_caches)
            if micro_batches <= most < size * micro_batches:
                size = max(1, most // micro_batches)
                reasons.append(f"micro-batch size capped at {size} by memory at that prefill budget")
    chosen = replace(requested, micro_batch_size=size, num_micro_batches=micro_batches,
                     num_slots=requested.num_slots or size * micro_batches, max_step_tokens=chunk)
    return Sizing(chosen.resolved(num_stages), tuple(reasons))


def _micro_batch_size(requested, profiles, memory, micro_batches, items, mean_context, tolerance,
                      reserve_fraction) -> tuple[int, str]:
    if requested.micro_batch_size:
        size, why = requested.micro_batch_size, f"micro-batch size {requested.micro_batch_size}: as given"
    elif any(p.layer_cost is not None for p in profiles) and memory is not None:
        profiles = [p for p in profiles if p.layer_cost is not None]  # fitted: they know their fixed part
        context = mean_context if mean_context is not None else requested.max_context / 4
        wanted = {p.name: rows_to_amortize(p, memory.num_layers, context, tolerance) for p in profiles}
        name = max(wanted, key=wanted.get)
        size = min(MAX_MICRO_BATCH, wanted[name])
        why = (f"micro-batch size {size}: the smallest whose cost per row is within {tolerance:.0%} of the "
               f"per-row cost alone on every stage ({name} needs the most rows, at a context of {context:.0f})")
    else:
        size, why = DEFAULT_MICRO_BATCH, (f"micro-batch size {DEFAULT_MICRO_BATCH}: the default (no measured "
                                          "profiles to tell the fixed cost of a step from its cost per row)")
    if items is not None and items > 0 and not requested.micro_batch_size:
        # Rows beyond the amortizing size still cost less each, while a job that does not fill its
        # slots evenly ends in a tail: 64 items in 49 slots ran 49 rows for 64 steps, then 15 rows for
        # 64 more (111 tok/s where one wave of 64 ran 173). So a known job gets a slot per item (up to
        # MAX_MICRO_BATCH per micro-batch, then memory decides); a smaller job spreads evenly.
        even = max(1, math.ceil(items / micro_batches))
        if even < size:
            why += f"; {even}: the job's {items} items spread over the {micro_batches} micro-batches"
            size = even
        elif even > size:
            size = min(MAX_MICRO_BATCH, even)
            why += (f"; {size}: a slot for each of the job's {items} items" if size == even else
                    f"; {size}: the most per micro-batch, for the job's {items} items")
    if memory is not None and profiles and not requested.micro_batch_size:
        prefixes = requested.prefix_cache
        most = max_slots(profiles, memory, requested.max_context, requested.max_step_tokens or DEFAULT_STEP_TOKENS,
                         reserve_fraction, prefixes.budget_tokens if prefixes.enabled else 0, micro_batches,
                         requested.keep_caches)
        if most // micro_batches < size:
            size = max(1, most // micro_batches)
            why += f"; capped at {size} by memory (KV for {most} slots x {requested.max_context} tokens fits)"
    return size, why


def choose_by_plan(requested, num_stages: int, profiles: Sequence[StageProfile], memory: ModelMemory | None,
                   plan_for: Callable[[object], object], items: int | None = None,
                   mean_context: float | None = None, reserve_fraction: float = 0.05) -> tuple[Sizing, object]:
    """`choose_batching` for each count of `micro_batch_counts`, each planned by `plan_for(batching)`
    (a planner.plan_values.Plan); the sizing whose plan predicts the most tokens/s, and that plan."""
    counts = micro_batch_counts(requested.num_micro_batches, num_stages)
    tried = []
    for count in counts:
        asked = requested if len(counts) == 1 else replace(requested, num_micro_batches=count)
        sizing = choose_batching(asked, num_stages, profiles, memory, items, mean_context,
                                 reserve_fraction=reserve_fraction)
        tried.append((sizing, plan_for(sizing.batching)))
    sizing, plan = max(tried, key=lambda pair: pair[1].chosen.tokens_per_s)
    if len(tried) == 1:
        return sizing, plan
    others = ", ".join(f"{s.batching.num_micro_batches} x {s.batching.micro_batch_size}: {p.chosen.tokens_per_s:.1f}"
                       for s, p in tried if s is not sizing)
    why = (f"micro-batches {sizing.batching.num_micro_batches} of {sizing.batching.micro_batch_size}: the fastest "
           f"predicted ({plan.chosen.tokens_per_s:.1f} tok/s; {others})")
    return Sizing(sizing.batching, (why,) + sizing.reasons), plan


def micro_batch_counts(requested_count: int, num_stages: int) -> tuple[int, ...]:
    """The micro-batch counts worth planning: the user's, or for a chain of several stages both one
    per stage (fewer, larger micro-batches: each step's matmuls run at more rows) and one per stage
    plus one (the broker's turnaround hidden). Which wins depends on how a step's cost falls with its
    rows against the broker's gap: 2 stages on the default model ran 2 x 32 at 167 tok/s and 3 x 22
    at 143, so the broker plans both and keeps the faster prediction."""
    if requested_count:
        return (requested_count,)
    if num_stages <= 1:
        return (default_micro_batches(num_stages),)
    return (num_stages, num_stages + 1)


def rows_to_amortize(profile: StageProfile, num_layers: int, context: float, tolerance: float) -> int:
    """The fewest decode rows whose cost per row is within `tolerance` of the per-row cost alone,
    for the whole model on this stage's device (every stage holds a share of layers, and the share
    scales fixed and per-row parts alike)."""
    one_row = StepWork(decode_rows=1, decode_kv=context + 1, emit_rows=1)
    per_row = profile.busy_s(one_row, num_layers, True, True)
    fixed = profile.busy_s(StepWork(steps=1, passes=1, emit_steps=1), num_layers, True, True)
    if per_row <= 0:
        return MAX_MICRO_BATCH
    return max(1, math.ceil(fixed / (tolerance * per_row)))


def max_slots(profiles: Sequence[StageProfile], memory: ModelMemory, max_context: int, step_tokens: int,
              reserve_fraction: float, prefix_cache_tokens: int = 0, micro_batches: int = 1,
              keep_sent: bool = True) -> int:
    """As fitting_slots, at least 1 (where none fits, the planner says why in its own words)."""
    return max(1, fitting_slots(profiles, memory, max_context, step_tokens, reserve_fraction, prefix_cache_tokens,
                                micro_batches, keep_sent))


def fitting_slots(profiles: Sequence[StageProfile], memory: ModelMemory, max_context: int, step_tokens: int,
                  reserve_fraction: float, prefix_cache_tokens: int = 0, micro_batches: int = 1,
                  keep_sent: bool = True) -> int:
    """Slots whose KV cache at the full context fits the stages' memory together, after the weights,
    the prefix cache, each stage's workspace and reserve (the planner then checks each stage's share
    exactly). Weights count in the format the stages were asked for; under --weights auto in the first of
    full precision, int8, int4 that leaves room for a slot, as the planner will choose. A slot also costs its
    row's share of the last stage's logits: a micro-batch of rows is scored at once (3 float32 vectors of the
    vocabulary per row), so a job of many items, sized to a slot each, must leave room for them; counting one
    row only, a 500-item job at a 4,096-token context was sized 90 MiB past what the planner then accepted."""
    room = sum(p.memory_budget * (1 - reserve_fraction) for p in profiles)
    room -= sum(memory.workspace_bytes(step_tokens, 0, max_context, i == 0) for i in range(len(profiles)))
    # A position's KV over all layers, plus the hidden state every stage but the last keeps of what it
    # sent on (stages.replay), for a slot's positions and the prefix cache's alike. Stages split the model
    # at whole layers, so each stage but the last may leave up to one layer's weights and KV unused.
    boundaries = len(profiles) - 1
    room -= boundaries * max(memory.layer_weight_bytes, default=0)
    per_position = ((memory.num_layers + boundaries) * memory.kv_bytes_per_token
                    + (boundaries * memory.activation_bytes_per_token if keep_sent else 0))
    per_slot = per_position * max_context + memory.workspace_bytes(0, 1, 0, True) / max(micro_batches, 1)
    requested = {p.weights for p in profiles}
    if "auto" in requested:
        known = [f.name for f in memory.formats]
        names = weight_candidates("auto", memory.full_format, len(AUTO_FALLBACKS), known)
    else:
        names = (max(requested, key=lambda name: _total(memory, name)),)
    totals = [_total(memory, name) for name in names]
    weights = next((total for total in totals if room - total >= per_slot), totals[-1])
    free = room - weights
    if per_slot <= 0:
        return MAX_MICRO_BATCH
    if not prefix_cache_tokens:
        return int(free // per_slot)
    # The prefix cache takes a quarter of the slots' positions, up to its budget (broker.prefix_cache).
    slot_kv = per_position * max_context
    slots = int(free // (per_slot + MAX_SHARE_OF_SLOTS * slot_kv))
    if slots * MAX_SHARE_OF_SLOTS * max_context > prefix_cache_tokens:  # the budget binds, not the share
        slots = int((free - per_position * prefix_cache_tokens) // per_slot)
    return slots


def _total(memory: ModelMemory, name: str) -> int:
    sizes = memory.weights_in(name)
    return sum(sizes.layer_weight_bytes) + sizes.embed_bytes + sizes.head_bytes


def _step_tokens(profiles: Sequence[StageProfile], rows: int, max_context: int, tolerance: float) -> tuple[int, str]:
    profiles = [p for p in profiles if p.layer_cost is not None]
    if not profiles:
        return DEFAULT_STEP_TOKENS, (f"prefill budget {DEFAULT_STEP_TOKENS} tokens per step: the default (no "
                                     "measured profiles)")
    wanted = 0
    for profile in profiles:
        fixed = profile.overhead.of(StepWork(steps=1)) + profile.layer.of(StepWork(passes=1))
        token = profile.layer.of(StepWork(prefill_tokens=1, prefill_ctx=prefill_context(0, 1)))
        if token > 0:
            wanted = max(wanted, math.ceil(fixed / (tolerance * token)))
    chunk = min(MAX_STEP_TOKENS, max(MIN_STEP_TOKENS, -(-wanted // 64) * 64))
    chunk = min(chunk, max_context)
    return rows + chunk, (f"prefill budget {rows + chunk} tokens per step: {rows} decode rows plus a chunk of "
                          f"{chunk}, the smallest (in 64s, at least {MIN_STEP_TOKENS}) whose cost per token is "
                          f"within {tolerance:.0%} of the per-token cost")
