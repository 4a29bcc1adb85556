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
by the link to the stage after it (planner.link_search).

A pipeline step here is what yields one new token per slot of a micro-batch: `micro_batch_size`
decode rows plus the prompt tokens the workload brings along per generated token
(`PlanOptions.prompt_tokens_per_new_token`), so predicted tokens/s count new tokens.

Its parts: the cost model (planner.cost_model), how long each window of a job lasts on a chain
(planner.window_pricing) and the searches (planner.chain_search); this module makes the plan of them.
"""

from __future__ import annotations

from typing import Sequence

from layerbus.planner.chain_search import by_job_time, search_chain, search_over_links
from layerbus.planner.cost_model import CostModel as _CostModel
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
from layerbus.planner.network import LinkMatrix
from layerbus.planner.weight_choice import AUTO_FALLBACKS, auto_levels
from layerbus.planner.window_pricing import Neighbours
from layerbus.planner.workload import JobShape
from layerbus.wire.spans import LayerRange

# How much exact search a plan may spend before it falls back to a heuristic, and says so in `plan.search`
SUBSET_DP_LIMIT = 6_000_000  # inner-loop steps above which the order search falls back to (first, last) pairs
PAIR_DP_LIMIT = 2_500_000  # (subsets x first stages x spans) above which the link-aware search is a heuristic
ENUMERATION_LIMIT = 4000  # candidate chains x splits priced window by window; beyond, improve the DP's answer


def plan_placement(stages: Sequence[StageProfile], model: ModelMemory, batching,
                   options: PlanOptions = PlanOptions(), job: JobShape | None = None,
                   network: LinkMatrix | None = None, neighbours: Neighbours = ()) -> Plan:
    """The placement that finishes the job soonest within every stage's memory.

    `stages` is any set of profiles (their order is the chain order when `allow_reorder` is off,
    and the equal split's order); `batching` is a BatchingConfig (resolved for len(stages) if it is
    not); `job` is the job's windows (broker.job_simulation.job_shape; None: a steady mix of decode and
    `options.prompt_tokens_per_new_token`); `network` the links between the stages (None: each
    stage sends at its own `link_bandwidth`, whoever follows it); `neighbours` other chains' stages
    working beside this chain (planner.window_pricing). Raises PlacementError when no placement fits."""
    if not stages:
        raise PlacementError("no stages to place the model on: start at least one stage")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise PlacementError(f"stage names must be unique, got {names}")
    shapes = batching if isinstance(batching, Shapes) else Shapes.from_batching(batching, len(stages))
    costs, chain, spans, search = _searched(stages, model, shapes, options, job, network, neighbours)
    if len(costs.windows) > 1 or costs.shared:
        chain, spans = by_job_time(costs, options, chain, spans, ENUMERATION_LIMIT)
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


def _searched(stages: Sequence[StageProfile], model: ModelMemory, shapes: Shapes, options: PlanOptions,
              job: JobShape | None, network: LinkMatrix | None, neighbours: Neighbours):
    """(the cost model, chain, spans, how they were searched) at the first weight level that places the
    model: stages under --weights auto in full precision first; int8, then int4, only if that finds no
    placement. Raises PlacementError, naming what is missing, when none does."""
    levels = ([level for level in auto_levels() if level <= options.max_auto_level]
              if any(s.weights == "auto" for s in stages) else [len(AUTO_FALLBACKS)])
    for level in levels:
        costs = _CostModel(stages, model, shapes, options, job, network, level, neighbours)
        if network is None:
            chain, spans, search = search_chain(costs, options, SUBSET_DP_LIMIT)
        else:
            chain, spans, search = search_over_links(costs, options, PAIR_DP_LIMIT)
        if chain:
            return costs, chain, spans, search
    raise PlacementError(_too_small_message(costs))


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


def _too_small_message(costs: _CostModel) -> str:
    """Why no placement fits: the bytes the model needs against what the stages hold, and the ways out."""
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
