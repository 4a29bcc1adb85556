"""How many chains to form from a pool of stages, and which stages go in each: a pure decision.

A model that fits on two of four stages can run as one chain of four or as two chains of two working
the job side by side. Which is faster is a matter of the stages' profiles: every chain pays a fixed
cost per step on each of its stages and a round trip through all of them, so fewer stages per chain
waste less; but every chain must hold the whole model (weights and KV cache) within its stages'
memory. Each grouping of the pool is priced with the placement planner (planner.placement), one chain
at a time, with the other chains' stages as its neighbours: on one machine CPU stages of different
chains compete for the same cores as a chain's own stages do (planner.window_pricing), so two chains on
two cores are predicted as what they are, not as two machines.

The grouping predicted to generate the most tokens/s in all wins, one chain being one candidate;
fewer chains win a near tie (within `ChainPlanOptions.fewer_chains_tolerance`): each chain is a broker
process and a share of the job's items, and a near tie is within the model's error.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from layerbus.planner.placement import PlacementError, Plan, StageProfile
from layerbus.planner.weight_choice import AUTO_FALLBACKS
from layerbus.planner.window_pricing import Neighbour, Neighbours

# A function that plans one chain over these stages with these neighbours, as one of `chains` chains on
# the job, each running an even share of its items (placement.plan_placement with the caller's model,
# batch sizes and that share of the job); raises PlacementError when they cannot hold the model
PlanOneChain = Callable[[Sequence[StageProfile], Neighbours, int], Plan]


@dataclass(frozen=True)
class ChainPlanOptions:
    """How the grouping is searched and chosen."""

    chains: int = 0  # the number of chains, pinned (--chains K); 0 = the planner chooses
    fewer_chains_tolerance: float = 0.05  # fewer chains win when within this share of the best prediction
    exhaustive_limit: int = 7  # pools up to this many stages try every grouping; larger ones consecutive groups
    rounds: int = 3  # each chain re-planned with the others' predicted busy shares this many times

    def __post_init__(self) -> None:
        if self.chains < 0:
            raise ValueError(f"chains must be 0 (chosen) or at least 1, got {self.chains}")


@dataclass(frozen=True)
class ChainGrouping:
    """One grouping of the pool: a plan per chain, each priced beside the others."""

    plans: tuple[Plan, ...]  # one per chain, in the order of their first stage in the pool

    @property
    def chains(self) -> int:
        return len(self.plans)

    @property
    def tokens_per_s(self) -> float:
        """Predicted new tokens/s of all chains together."""
        return sum(plan.tokens_per_s for plan in self.plans)

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        """Each chain's stages in its chain order (stages a chain's plan leaves out are not in it)."""
        return tuple(tuple(plan.order) for plan in self.plans)

    @property
    def left_out(self) -> tuple[str, ...]:
        return tuple(name for plan in self.plans for name in plan.left_out)

    def to_json(self) -> dict:
        return {"chains": self.chains, "tokens_per_s": self.tokens_per_s,
                "groups": [list(group) for group in self.groups], "left_out": list(self.left_out),
                "plans": [plan.to_json() for plan in self.plans]}


@dataclass(frozen=True)
class ChainsPlan:
    """The chosen grouping, one chain over the whole pool beside it, and the best of each count tried."""

    chosen: ChainGrouping
    single: ChainGrouping | None  # one chain over every stage (None: it does not fit)
    best_by_count: tuple[ChainGrouping, ...]  # the best grouping found for each number of chains, fewest first
    search: str  # "every grouping", or how the search was narrowed, in words

    @property
    def gain(self) -> float | None:
        """Chosen over one chain, predicted tokens/s (None: no single chain to compare with)."""
        if self.single is None or self.single.tokens_per_s <= 0:
            return None
        return self.chosen.tokens_per_s / self.single.tokens_per_s

    def to_json(self) -> dict:
        return {"chosen": self.chosen.to_json(), "single": self.single.to_json() if self.single else None,
                "gain_over_single": self.gain, "search": self.search,
                "by_count": [{"chains": g.chains, "tokens_per_s": g.tokens_per_s,
                              "groups": [list(group) for group in g.groups]} for g in self.best_by_count]}


def plan_chains(profiles: Sequence[StageProfile], plan_one: PlanOneChain,
                options: ChainPlanOptions = ChainPlanOptions()) -> ChainsPlan:
    """The grouping of `profiles` into chains predicted fastest (or the fastest with `options.chains`
    chains). Raises PlacementError when no grouping holds the model (then one chain of all does not
    either: the message is that chain's)."""
    if not profiles:
        raise PlacementError("no stages to form chains from: start at least one stage")
    if options.chains > len(profiles):
        raise PlacementError(f"{options.chains} chains need at least {options.chains} stages; there are "
                             f"{len(profiles)}: use --chains {len(profiles)} or fewer")
    # Pinned or not, one chain over all is priced too: it is what the choice is shown beside.
    counts = sorted({1, options.chains}) if options.chains else list(range(1, len(profiles) + 1))
    exhaustive = len(profiles) <= options.exhaustive_limit
    best: dict[int, ChainGrouping] = {}
    first_error: PlacementError | None = None
    for groups in _groupings(profiles, counts, exhaustive):
        try:
            grouping = price_grouping(groups, plan_one, options.rounds)
        except PlacementError as error:
            if first_error is None or len(groups) == 1:  # one chain over all says best why nothing fits
                first_error = error
            continue
        count = len(groups)
        if count > 1 and 1 in best and not quantized_formats(grouping) <= quantized_formats(best[1]):
            continue  # under --weights auto a chain would hold fewer bits than one chain of all: other outputs
        if count not in best or grouping.tokens_per_s > best[count].tokens_per_s:
            best[count] = grouping
    if not best:
        raise first_error or PlacementError("no grouping of the stages holds the model")
    ranked = [best[count] for count in sorted(best)]
    if options.chains:
        if options.chains not in best:
            raise PlacementError(f"no grouping of the {len(profiles)} stages into {options.chains} chains holds "
                                 f"the model (each chain holds all of it); use fewer chains. One grouping's "
                                 f"answer: {first_error}")
        chosen = best[options.chains]
    else:
        chosen = choose_grouping(ranked, options.fewer_chains_tolerance)
    search = ("every grouping" if exhaustive else
              f"{len(profiles)} stages have too many groupings to try each: consecutive groups in the given order")
    return ChainsPlan(chosen, best.get(1), tuple(ranked), search)


def quantized_formats(grouping: ChainGrouping) -> set[str]:
    """The formats `--weights auto` fell back to (int8, int4) on some stage of the grouping: a grouping
    whose chains are each too small for full precision would trade outputs for speed, which auto does
    only where the model fits no other way."""
    return {stage.weights for plan in grouping.plans for stage in plan.stages
            if stage.requested_weights == "auto" and stage.weights in AUTO_FALLBACKS}


def choose_grouping(ranked: Sequence[ChainGrouping], tolerance: float) -> ChainGrouping:
    """The fewest chains predicted within `tolerance` of the fastest grouping."""
    fastest = max(grouping.tokens_per_s for grouping in ranked)
    return min((g for g in ranked if g.tokens_per_s >= fastest * (1 - tolerance)), key=lambda g: g.chains)


def price_grouping(groups: Sequence[Sequence[StageProfile]], plan_one: PlanOneChain, rounds: int = 3) -> ChainGrouping:
    """Each group planned as one chain, first alone, then `rounds` times with the other groups' stages
    as its neighbours, busy as the previous round predicted them (averaged with the round before, so
    that a pessimistic round and an optimistic one do not take turns). Raises PlacementError when a
    group cannot hold the model."""
    plans = [plan_one(group, (), len(groups)) for group in groups]
    if len(groups) == 1:
        return ChainGrouping(tuple(plans))
    by_name = {profile.name: profile for group in groups for profile in group}
    shares = _shares(plans, by_name)
    for _ in range(max(1, rounds)):
        plans = []
        for group in groups:
            names = {profile.name for profile in group}
            neighbours = tuple(Neighbour(p, *shares[p.name]) for other in groups if other is not group
                               for p in other if p.name not in names)
            plans.append(plan_one(group, neighbours, len(groups)))
        new = _shares(plans, by_name)
        shares = {name: tuple((a + b) / 2 for a, b in zip(shares[name], new[name])) for name in shares}
    return ChainGrouping(tuple(plans))


def _shares(plans: Sequence[Plan], profiles: dict[str, StageProfile]) -> dict[str, tuple[float, float]]:
    """Each stage's (share of the job's time busy, cores it keeps computing) as its chain's plan predicts
    them; (0, 0) for a stage its plan leaves out. The cores are its busy time as if it had its host to
    itself, less what an emulated slower device sleeps, times its threads."""
    shares = {name: (0.0, 0.0) for name in profiles}
    for plan in plans:
        estimate = plan.chosen
        if estimate.job_s <= 0:
            continue
        for stage in estimate.stages:
            profile = profiles[stage.name]
            alone = stage.alone_s if stage.alone_s is not None else stage.step_s
            shares[stage.name] = (min(1.0, stage.step_s * estimate.steps / estimate.job_s),
                                  alone * estimate.steps / estimate.job_s * profile.compute_share
                                  * max(1, profile.threads))
    return shares


def _groupings(profiles: Sequence[StageProfile], counts: Sequence[int],
               exhaustive: bool) -> Iterator[list[list[StageProfile]]]:
    """Groupings of the pool into each of `counts` chains, each once up to stages that are alike (same
    profile but the name): with four alike stages, 2 + 2 is tried once, not three times."""
    seen: set[tuple] = set()
    # Consecutive groups first: among alike stages, stage-0 and stage-1 go together rather than 0 and 3.
    source = itertools.chain(_consecutive(list(profiles)), _set_partitions(list(profiles)) if exhaustive else ())
    wanted = set(counts)
    for groups in source:
        if len(groups) not in wanted:
            continue
        key = tuple(sorted(tuple(sorted(_likeness(p) for p in group)) for group in groups))
        if key in seen:
            continue
        seen.add(key)
        position = {p.name: i for i, p in enumerate(profiles)}
        yield sorted(groups, key=lambda group: min(position[p.name] for p in group))


def _likeness(profile: StageProfile) -> str:
    """What tells stages apart for the planner: everything in the profile but the name."""
    from dataclasses import replace

    return repr(replace(profile, name=""))


def _set_partitions(items: list) -> Iterator[list[list]]:
    """Every partition of `items` into non-empty groups, each group in the items' order."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first]] + partition
        for i in range(len(partition)):
            yield partition[:i] + [[first] + partition[i]] + partition[i + 1:]


def _consecutive(items: list) -> Iterator[list[list]]:
    """Every split of `items` into consecutive runs (2^(n-1) of them)."""
    n = len(items)
    for mask in range(1 << max(0, n - 1)):
        groups, current = [], [items[0]]
        for i in range(1, n):
            if mask >> (i - 1) & 1:
                groups.append(current)
                current = []
            current.append(items[i])
        groups.append(current)
        yield groups
