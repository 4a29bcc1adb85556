"""Cutting layers into stage spans: equal counts, and the cost-balanced cut checked against an
exhaustive search over every possible set of cut points."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest

from layerbus.planner.partition import ModelCost, balanced_partition, equal_partition, model_cost_from_config, stage_costs
from layerbus.wire.spans import LayerRange


def spans_of(*bounds: int) -> list[LayerRange]:
    return [LayerRange(start, end) for start, end in zip(bounds, bounds[1:])]


def assert_tiles(spans: list[LayerRange], num_layers: int) -> None:
    """Contiguous, half-open, non-empty spans covering [0, num_layers) exactly once."""
    assert spans[0].start == 0 and spans[-1].end == num_layers
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert all(len(span) >= 1 for span in spans)
    assert [layer for span in spans for layer in span] == list(range(num_layers))


# -- equal partition ------------------------------------------------------------------------------

EQUAL = {
    "30 layers, 1 stage": (30, 1, spans_of(0, 30)),
    "30 layers, 2 stages": (30, 2, spans_of(0, 15, 30)),
    "30 layers, 3 stages": (30, 3, spans_of(0, 10, 20, 30)),
    "30 layers, 4 stages: first two take the remainder": (30, 4, spans_of(0, 8, 16, 23, 30)),
    "30 layers, 7 stages": (30, 7, spans_of(0, 5, 10, 14, 18, 22, 26, 30)),
    "7 layers, 7 stages": (7, 7, spans_of(*range(8))),
    "1 layer, 1 stage": (1, 1, spans_of(0, 1)),
    "10 layers, 3 stages": (10, 3, spans_of(0, 4, 7, 10)),
}


@pytest.mark.parametrize("num_layers, num_stages, expected", EQUAL.values(), ids=EQUAL.keys())
def test_equal_partition(num_layers: int, num_stages: int, expected: list[LayerRange]) -> None:
    spans = equal_partition(num_layers, num_stages)
    assert spans == expected
    assert_tiles(spans, num_layers)


@pytest.mark.parametrize("num_layers, num_stages", [pytest.param(n, s, id=f"{n} layers, {s} stages")
                                                    for n in (1, 5, 30, 31, 64) for s in (1, 2, 3, 5) if s <= n])
def test_equal_partition_sizes_differ_by_at_most_one(num_layers: int, num_stages: int) -> None:
    spans = equal_partition(num_layers, num_stages)
    assert_tiles(spans, num_layers)
    sizes = [len(span) for span in spans]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the remainder sits on the first stages


PARTITION_ERRORS = {
    "no stages": (30, 0, r"need at least one stage, got num_stages=0"),
    "negative stages": (30, -2, r"need at least one stage, got num_stages=-2"),
    "more stages than layers": (3, 4, r"num_stages=4 exceeds num_layers=3: every stage needs at least one layer"),
    "no layers": (0, 1, r"num_stages=1 exceeds num_layers=0"),
}


@pytest.mark.parametrize("num_layers, num_stages, message", PARTITION_ERRORS.values(), ids=PARTITION_ERRORS.keys())
def test_equal_partition_errors_name_the_values(num_layers: int, num_stages: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        equal_partition(num_layers, num_stages)


@pytest.mark.parametrize("num_layers, num_stages, message", PARTITION_ERRORS.values(), ids=PARTITION_ERRORS.keys())
def test_balanced_partition_errors_name_the_values(num_layers: int, num_stages: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balanced_partition(ModelCost(layer=(1.0,) * num_layers), num_stages)


# -- balanced partition ---------------------------------------------------------------------------

def brute_force_min_max(cost: ModelCost, num_stages: int) -> float:
    """The smallest largest-stage cost over every way to cut the layers into non-empty spans."""
    n = cost.num_layers
    best = math.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        best = min(best, max(stage_costs(cost, spans_of(0, *cuts, n))))
    return best


def random_instance(rng: random.Random) -> tuple[ModelCost, int]:
    num_layers = rng.randint(1, 10)
    num_stages = rng.randint(1, min(5, num_layers))
    layer = tuple(rng.choice([rng.uniform(0.1, 10.0), float(rng.randint(1, 4))]) for _ in range(num_layers))
    cost = ModelCost(layer=layer, embed=rng.choice([0.0, rng.uniform(0, 5)]), head=rng.uniform(0, 20))
    return cost, num_stages


@pytest.mark.parametrize("seed", range(4), ids=lambda seed: f"seed{seed}")
def test_balanced_partition_matches_exhaustive_search(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):  # 4 seeds x 50 = 200 random instances
        cost, num_stages = random_instance(rng)
        spans = balanced_partition(cost, num_stages)
        assert len(spans) == num_stages
        assert_tiles(spans, cost.num_layers)
        got = max(stage_costs(cost, spans))
        want = brute_force_min_max(cost, num_stages)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (cost, num_stages, spans)


BALANCED = {
    "uniform layers, no extras: equal split": (ModelCost(layer=(1.0,) * 6), 3, spans_of(0, 2, 4, 6)),
    "heavy head pulls layers off the last stage": (ModelCost(layer=(1.0,) * 6, head=2.0), 2, spans_of(0, 4, 6)),
    "heavy embedding pushes layers off the first stage": (ModelCost(layer=(1.0,) * 6, embed=2.0), 2,
                                                          spans_of(0, 2, 6)),
    "one heavy layer gets a stage to itself": (ModelCost(layer=(1.0, 1.0, 9.0, 1.0, 1.0)), 3, spans_of(0, 2, 3, 5)),
    "huge head still leaves the last stage one layer": (ModelCost(layer=(1.0,) * 4, head=100.0), 2,
                                                        spans_of(0, 3, 4)),
    "one stage holds everything": (ModelCost(layer=(3.0, 1.0), embed=1.0, head=1.0), 1, spans_of(0, 2)),
    "as many stages as layers": (ModelCost(layer=(5.0, 1.0, 2.0)), 3, spans_of(0, 1, 2, 3)),
}


@pytest.mark.parametrize("cost, num_stages, expected", BALANCED.values(), ids=BALANCED.keys())
def test_balanced_partition_table(cost: ModelCost, num_stages: int, expected: list[LayerRange]) -> None:
    assert balanced_partition(cost, num_stages) == expected


def test_stage_costs_put_embedding_first_and_head_last() -> None:
    cost = ModelCost(layer=(1.0, 2.0, 3.0, 4.0), embed=10.0, head=100.0)
    assert stage_costs(cost, spans_of(0, 1, 3, 4)) == [11.0, 5.0, 104.0]
    assert stage_costs(cost, spans_of(0, 4)) == [120.0]


SMOLLM2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          intermediate_size=1536, vocab_size=49152, num_hidden_layers=30)


def test_model_cost_from_config_smollm2_shape() -> None:
    cost = model_cost_from_config(SMOLLM2)
    assert cost.num_layers == 30
    assert len(set(cost.layer)) == 1
    # 2 FLOPs per weight: q, o (9 heads x 64) and k, v (3 heads x 64), plus the 3-matrix MLP.
    assert cost.layer[0] == 2 * (576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536)
    assert cost.head == 2 * 576 * 49152
    assert cost.head / cost.layer[0] == pytest.approx(8.0)
    assert cost.embed == 0.0


def test_model_cost_without_head_dim_or_kv_heads_falls_back_to_the_attention_shape() -> None:
    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100,
                             num_hidden_layers=2)
    cost = model_cost_from_config(config)
    assert cost.layer == (2.0 * (64 * 16 * 16 + 3 * 64 * 128),) * 2


def test_smollm2_two_stages_last_stage_gets_fewer_layers() -> None:
    cost = model_cost_from_config(SMOLLM2)
    first, last = balanced_partition(cost, 2)
    assert_tiles([first, last], 30)
    assert len(last) < len(first)
    assert (first, last) == (LayerRange(0, 19), LayerRange(19, 30))  # 19 vs 11 + 8 layers' worth of head
    balanced, equal = max(stage_costs(cost, [first, last])), max(stage_costs(cost, equal_partition(30, 2)))
    assert balanced < equal
