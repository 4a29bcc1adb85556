"""The chain planner (planner/chain_plan.py): how many chains a pool of stages forms and which stages go
in each, priced with the placement planner, other chains' stages competing for a host's cores (pure)."""

from __future__ import annotations

import pytest

from layerbus.planner.chain_plan import ChainPlanOptions, plan_chains, price_grouping
from layerbus.planner.placement import PlacementError, PlanOptions, plan_placement
from tests.helpers.chain_cases import HALF_MODEL_BUDGET, MODEL, plan_one, stage
from tests.helpers.placement_cases import SHAPES

WHOLE_MODEL = sum(MODEL.layer_weight_bytes) + MODEL.embed_bytes + MODEL.head_bytes


@pytest.mark.parametrize("overhead, want_chains", [
    (0.0, 1),  # no fixed cost per step: four stages of a quarter each are as fast as two of a half
    (0.05, 2),  # a fixed cost on every stage's step: a chain of two pays it twice per token, not four times
])
def test_the_fixed_cost_per_step_decides_between_one_chain_of_four_and_two_of_two(overhead, want_chains) -> None:
    pool = [stage(f"stage-{i}", overhead=overhead, budget=HALF_MODEL_BUDGET) for i in range(4)]  # hosts apart
    plan = plan_chains(pool, plan_one)
    assert plan.chosen.chains == want_chains
    assert plan.single is not None and plan.single.chains == 1
    if want_chains == 2:
        assert plan.chosen.groups == (("stage-0", "stage-1"), ("stage-2", "stage-3"))
        assert plan.gain > 1.2
    else:
        assert plan.gain == 1.0


def test_every_chain_holds_the_whole_model_within_its_stages_memory() -> None:
    # Each stage holds a little over half the model: chains of one stage cannot exist, nor 3 + 1.
    pool = [stage(f"stage-{i}", overhead=0.05, budget=HALF_MODEL_BUDGET) for i in range(4)]
    with pytest.raises(PlacementError):
        plan_placement(pool[:1], MODEL, SHAPES)
    plan = plan_chains(pool, plan_one)
    assert [g.chains for g in plan.best_by_count] == [1, 2]
    assert plan.chosen.chains == 2
    with pytest.raises(PlacementError, match="into 3 chains"):
        plan_chains(pool, plan_one, ChainPlanOptions(chains=3))


def test_chains_on_one_host_share_its_cores() -> None:
    # Four one-thread CPU stages on a two-core machine: two chains cannot each have the two cores.
    pool = [stage(f"stage-{i}", overhead=0.01, host="box", cores=2, threads=1) for i in range(4)]
    apart = [stage(f"stage-{i}", overhead=0.01, host=f"box-{i}", cores=2, threads=1) for i in range(4)]
    groups = [pool[:2], pool[2:]]
    shared = price_grouping(groups, plan_one)
    alone = price_grouping([apart[:2], apart[2:]], plan_one)
    assert shared.tokens_per_s < 0.75 * alone.tokens_per_s
    # No more cores kept busy than the machine has: what every chain's stages compute (as if alone, one
    # thread each), over the job's time
    demand = 0.0
    for plan in shared.plans:
        for placement in plan.chosen.stages:
            demand += placement.alone_s * plan.chosen.steps / plan.chosen.job_s
    assert 1.5 < demand <= 2 * 1.02
    # Each chain planned without its neighbours would predict the cores twice over.
    blind = sum(plan_placement(group, MODEL, SHAPES, PlanOptions()).tokens_per_s for group in groups)
    assert blind > 1.3 * shared.tokens_per_s


def test_a_slower_device_leaves_cores_free_for_the_other_chain() -> None:
    # Stages emulating a device at 0.3 of a core's speed sleep 70% of their busy time: four fit two cores
    # better than four that compute all the time, and two chains of two gain more over one chain of four.
    def gain(share: float) -> float:
        pool = [stage(f"stage-{i}", overhead=0.05, host="box", cores=2, threads=1, share=share) for i in range(4)]
        return plan_chains(pool, plan_one, ChainPlanOptions(chains=2)).gain

    assert gain(0.3) > 1.2
    assert gain(0.3) > gain(1.0) + 0.05


def test_pinned_chains_are_kept_and_compared_with_one_chain() -> None:
    pool = [stage(f"stage-{i}") for i in range(3)]
    plan = plan_chains(pool, plan_one, ChainPlanOptions(chains=3))
    assert plan.chosen.chains == 3 and plan.chosen.groups == (("stage-0",), ("stage-1",), ("stage-2",))
    assert plan.single is not None and plan.single.groups == (("stage-0", "stage-1", "stage-2"),)
    assert [g.chains for g in plan.best_by_count] == [1, 3]


def test_alike_stages_are_grouped_once_and_different_ones_every_way() -> None:
    calls = []

    def counting(group, neighbours, chains):
        calls.append(tuple(p.name for p in group))
        return plan_one(group, neighbours, chains)

    alike = [stage(f"stage-{i}", overhead=0.05) for i in range(4)]
    plan_chains(alike, counting, ChainPlanOptions(rounds=1))
    # 1 x 4, 3 + 1, 2 + 2, 2 + 1 + 1, 1 + 1 + 1 + 1: the single chain once, the 2 + 2 + 3 + 4 chains of the
    # others each alone and then beside their neighbours
    assert len(calls) == 1 + 2 * 11
    calls.clear()
    mixed = [stage(f"stage-{i}", layer=0.01 * (i + 1)) for i in range(4)]
    plan_chains(mixed, counting, ChainPlanOptions(rounds=1))
    # every set partition of four stages (15): 1 + 2 * (4*2 + 3*2 + 6*3 + 1*4) chains
    assert len(calls) == 1 + 2 * 36


def test_a_large_pool_tries_consecutive_groups_only() -> None:
    pool = [stage(f"stage-{i}", overhead=0.05, layer=0.01 * (1 + i % 3)) for i in range(8)]
    plan = plan_chains(pool, plan_one, ChainPlanOptions(exhaustive_limit=4, rounds=1))
    assert "consecutive" in plan.search
    position = {f"stage-{i}": i for i in range(8)}
    for group in plan.chosen.groups:
        indices = sorted(position[name] for name in group)
        assert indices == list(range(indices[0], indices[0] + len(indices)))


def test_errors_name_the_problem_and_the_way_out() -> None:
    with pytest.raises(PlacementError, match="use --chains 2 or fewer"):
        plan_chains([stage("a"), stage("b")], plan_one, ChainPlanOptions(chains=3))
    with pytest.raises(PlacementError, match="short"):
        plan_chains([stage("a", budget=1000), stage("b", budget=1000)], plan_one)
    with pytest.raises(ValueError, match="chains must be"):
        ChainPlanOptions(chains=-1)
