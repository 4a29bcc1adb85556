"""The planner sizes each stage's weights in its format, and under `--weights auto` chooses it: full
precision where the stage's memory allows, else int8, else int4 (pure functions and table tests; the
sizes themselves are checked against what a loaded shard of the tiny model holds)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from layerbus.planner.chain import Placement
from layerbus.planner.model_memory import model_memory
from layerbus.planner.placement import PlacementError, PlanOptions, plan_placement
from layerbus.planner.plan_values import FormatWeights, ModelMemory
from layerbus.planner.plan_report import weights_reason
from layerbus.planner.planning import stage_weights
from layerbus.broker.profiling import format_layer_costs
from layerbus.planner.step_cost import LinearCost, decode_step, prefill_step
from layerbus.planner.weight_choice import assigned_weights, first_that_fits, weight_candidates
from layerbus.models.model_files import open_model_dir
from layerbus.models.weight_blocks import LAYOUTS
from layerbus.models.weight_sizes import BLOCK_BYTES
from layerbus.wire.spans import LayerRange
from tests.helpers.placement_cases import SHAPES, profile

KNOWN = ("fp32", "bf16", "fp16", "int8", "int4", "native")


@pytest.mark.parametrize("requested, full, level, known, expected", [
    ("auto", "fp32", 0, KNOWN, ("fp32",)),
    ("auto", "fp32", 1, KNOWN, ("fp32", "int8")),
    ("auto", "fp32", 2, KNOWN, ("fp32", "int8", "int4")),
    ("auto", "bf16", 2, KNOWN, ("bf16", "int8", "int4")),
    ("auto", "fp32", 2, (), ("fp32",)),  # a model sized in its dtype only: nothing else to choose
    ("int4", "fp32", 0, KNOWN, ("int4",)),  # asked for: whatever the level
    ("native", "fp32", 2, KNOWN, ("native",)),
    ("fp32", "bf16", 2, KNOWN, ("fp32",)),
])
def test_weight_candidates(requested, full, level, known, expected):
    assert weight_candidates(requested, full, level, known) == expected


NEEDS = {"fp32": 400, "int8": 110, "int4": 70}


@pytest.mark.parametrize("room, expected", [
    (1000, "fp32"), (400, "fp32"), (399, "int8"), (110, "int8"), (109, "int4"), (70, "int4"), (69, None),
])
def test_first_that_fits(room, expected):
    assert first_that_fits(("fp32", "int8", "int4"), NEEDS.__getitem__, room) == expected


@pytest.mark.parametrize("requested, chosen, told", [
    ("auto", "fp32", "auto"),  # full precision: the stage keeps its own --dtype
    ("auto", "bf16", "auto"),
    ("auto", "int8", "int8"),
    ("auto", "int4", "int4"),
    ("int4", "int4", "int4"),
    ("native", "native", "native"),
])
def test_assigned_weights(requested, chosen, told):
    assert assigned_weights(requested, chosen) == told


def formats_model(num_layers: int = 4) -> ModelMemory:
    """Layers of 100 bytes in fp32, 27 in int8, 16 in int4 (a SmolLM2 layer's ratios); ends kept in fp32."""
    formats = tuple(FormatWeights(name, (size,) * num_layers, 200, 220)
                    for name, size in (("fp32", 100), ("bf16", 50), ("fp16", 50), ("int8", 27), ("int4", 16),
                                       ("native", 16)))
    return ModelMemory(layer_weight_bytes=(100,) * num_layers, embed_bytes=200, head_bytes=220,
                       head_shares_embed=False, kv_bytes_per_token=1, activation_bytes_per_token=8, hidden_size=2,
                       intermediate_size=4, num_attention_heads=1, vocab_size=8, dtype_bytes=4, formats=formats)


OPTIONS = PlanOptions(reserve_fraction=0.0, allow_drop=False, allow_reorder=False)
# Workspace of SHAPES on this model: 4 x (4 x 2 + 3 x 4) x 4 + 1 x 4 x 8 x 4 (+ logits on the last stage)
KV_PER_LAYER = SHAPES.num_slots * SHAPES.max_context  # 32 bytes
SENT = 8 * KV_PER_LAYER  # what a stage that sends on keeps of it: 8 bytes of hidden state per position


def plan_formats(budgets, weights=("auto", "auto"), layers=4):
    stages = [profile(f"s{i}", 1.0, budget=b) for i, b in enumerate(budgets)]
    stages = [s.__class__(**{**vars(s), "weights": w}) for s, w in zip(stages, weights)]
    plan = plan_placement(stages, formats_model(layers), SHAPES, OPTIONS)
    return [(s.layers, s.weights) for s in plan.stages]


@pytest.mark.parametrize("budgets, weights, expected", [
    # Roomy: full precision on both stages
    ((10_000, 10_000), ("auto", "auto"), [(LayerRange(0, 2), "fp32"), (LayerRange(2, 4), "fp32")]),
    # The last stage holds one layer in fp32 beside the head (220 + 100 + KV 32 + workspace 640 = 992):
    # the split moves, nothing is quantized
    ((10_000, 1_000), ("auto", "auto"), [(LayerRange(0, 3), "fp32"), (LayerRange(3, 4), "fp32")]),
    # Not even that: one layer in int8 (220 + 27 + 32 + 640 = 919)
    ((10_000, 950), ("auto", "auto"), [(LayerRange(0, 3), "fp32"), (LayerRange(3, 4), "int8")]),
    # Nor in int8: int4 (220 + 16 + 32 + 640 = 908)
    ((10_000, 910), ("auto", "auto"), [(LayerRange(0, 3), "fp32"), (LayerRange(3, 4), "int4")]),
    # Asked for: int4 even where fp32 fits
    ((10_000, 10_000), ("int4", "auto"), [(LayerRange(0, 2), "int4"), (LayerRange(2, 4), "fp32")]),
])
def test_auto_chooses_full_precision_where_it_fits_else_int8_else_int4(budgets, weights, expected):
    assert plan_formats(budgets, weights) == expected


def test_auto_does_not_quantize_to_be_faster_on_paper():
    """A fast stage with room for one layer in fp32 beside a slow one: quantizing would let the fast one
    take more layers (a faster plan), but a plan in full precision exists, so the planner keeps it: quality
    first, even where the stages measured the quantized formats faster."""
    fast = profile("fast", 0.1, budget=900 + SENT)
    fast = replace(fast, format_layer_costs=(("int8", fast.layer.scaled(0.5)), ("int4", fast.layer.scaled(0.5))))
    slow = profile("slow", 1.0, budget=10_000)
    plan = plan_placement([fast, slow], formats_model(), SHAPES, OPTIONS)
    assert [s.weights for s in plan.stages] == ["fp32", "fp32"]
    assert [len(s.layers) for s in plan.stages] == [1, 3]
    assert plan.stages[0].faster_format == ("int4", 0.5)  # told, not chosen
    assert "int4 measured 0.50x its time on this stage: --weights int4 would trade quality" in weights_reason(plan.stages[0])
    assert plan.stages[1].faster_format is None  # measured nothing apart


def test_a_quantized_span_is_priced_at_the_speed_its_stage_measured_in_that_format():
    """The budgets force int4 onto s1's one layer. Where s1 timed its int4 layers 4x slower than fp32
    (a 1.28B model's shapes on this CPU), the plan prices that layer at 4x, in its compute time, its
    tokens/s and `plan --explain`; without that measurement it is priced as fp32, as before."""
    s0, s1 = profile("s0", 1.0, budget=10_000), profile("s1", 1.0, budget=910)
    measured = replace(s1, format_layer_costs=(("int8", s1.layer.scaled(1.5)), ("int4", s1.layer.scaled(4.0))))
    unpriced = plan_placement([s0, s1], formats_model(), SHAPES, OPTIONS)
    priced = plan_placement([s0, measured], formats_model(), SHAPES, OPTIONS)
    assert [(s.layers, s.weights) for s in priced.stages] == [(LayerRange(0, 3), "fp32"), (LayerRange(3, 4), "int4")]
    assert priced.stages[1].compute_s == pytest.approx(4.0 * unpriced.stages[1].compute_s)
    assert priced.stages[0].compute_s == pytest.approx(unpriced.stages[0].compute_s)
    assert priced.tokens_per_s < unpriced.tokens_per_s
    assert priced.stages[1].format_speed == pytest.approx(4.0) and unpriced.stages[1].format_speed is None
    assert "decode step measured 4.00x full precision's time" in weights_reason(priced.stages[1])
    assert plan_formats((10_000, 10_000)) == [(LayerRange(0, 2), "fp32"), (LayerRange(2, 4), "fp32")]


def test_the_format_costs_scale_the_matmuls_to_the_measured_ratios_and_keep_attention():
    layer = LinearCost(per_pass_s=1e-3, per_row_s=1e-4, per_row_kv_s=1e-7, per_token_s=2e-4, per_token_ctx_s=1e-8)
    decode, prefill = decode_step(32, 256), prefill_step(256)
    (name, cost), = format_layer_costs({"int4": {"decode": 3.0, "prefill": 2.0}}, layer, decode, prefill)
    assert name == "int4"
    assert cost.of(decode) == pytest.approx(3.0 * layer.of(decode))
    assert cost.of(prefill) == pytest.approx(2.0 * layer.of(prefill))
    assert (cost.per_row_kv_s, cost.per_token_ctx_s) == (layer.per_row_kv_s, layer.per_token_ctx_s)
    assert cost.of(decode_step(32, 2048)) < 3.0 * layer.of(decode_step(32, 2048))  # longer caches: attention unchanged
    for broken in (None, {"int4": {"decode": -1.0, "prefill": 2.0}}, {"int4": {"decode": True, "prefill": 2.0}},
                   {"int4": "fast"}, {"int4": {"decode": 2.0}}):
        assert format_layer_costs(broken, layer, decode, prefill) == ()
    assert format_layer_costs({"int4": {"decode": 3.0, "prefill": 2.0}}, None, decode, prefill) == ()


def test_too_small_even_in_int4_names_the_format_and_the_ways_out():
    with pytest.raises(PlacementError, match=r"in int4.*Ways out: add stages or memory"):
        plan_formats((700, 700))
    with pytest.raises(PlacementError, match=r"in fp32.*hold the weights in fewer bits"):
        plan_formats((700, 700), weights=("fp32", "fp32"))


def test_stage_weights_tells_quantized_choices_and_keeps_auto_for_full_precision():
    stages = [profile("s0", 1.0, budget=10_000), profile("s1", 1.0, budget=910)]
    plan = plan_placement(stages, formats_model(), SHAPES, OPTIONS)
    placement = Placement(tuple(plan.order), tuple(plan.spans), partition="planned", plan=plan)
    assert stage_weights(placement, "auto") == ["auto", "int4"]
    unplanned = Placement(("s0", "s1"), (LayerRange(0, 2), LayerRange(2, 4)), partition="equal")
    assert stage_weights(unplanned, "int8") == ["int8", "int8"]


def test_block_bytes_agree_with_the_block_code():
    assert BLOCK_BYTES == {name: layout.block_bytes for name, layout in LAYOUTS.items()}


@pytest.mark.parametrize("weights, layout", [("int8", "q8_0"), ("int4", "q4_1"), ("bf16", None), ("fp32", None)])
def test_planned_weight_bytes_are_what_a_loaded_shard_holds(tiny_models, weights, layout):
    """Each stage's weight bytes in the plan equal the loaded shard's own count, in every format."""
    from layerbus.stages.shard import ShardSpec, load_shard
    from layerbus.wire.weight_formats import choose_weights

    model_dir = tiny_models("llama", num_hidden_layers=4)
    files = open_model_dir(model_dir)
    memory = model_memory(files)
    choice = choose_weights(None, weights, "float32")
    for span, first, last in ((LayerRange(0, 2), True, False), (LayerRange(2, 4), False, True),
                              (LayerRange(0, 4), True, True)):
        shard = load_shard(files, ShardSpec(span, first, last, "cpu", choice.dtype, choice.quantize_to))
        sizes = memory.weights_in(weights)
        planned = sum(sizes.layer_weight_bytes[span.start:span.end])
        planned += (sizes.embed_bytes if first else 0) + (sizes.head_bytes if last else 0)
        if first and last and memory.head_shares_embed:
            planned -= sizes.embed_bytes
        assert shard.parameter_bytes() == planned, (weights, span)
        assert shard.block_layouts() == layout


@pytest.mark.parametrize("sizes, stages, expected", [
    ([], 3, ()),
    (["1GiB"], 2, (("--memory-budget", "1GiB"), ("--memory-budget", "1GiB"))),
    (["1GiB", "-"], 2, (("--memory-budget", "1GiB"), ())),
])
def test_run_memory_budget_gives_each_local_stage_its_budget(sizes, stages, expected):
    from argparse import Namespace

    from layerbus.cli.run import stage_budgets

    assert stage_budgets(Namespace(memory_budget=sizes, stages=stages)) == expected


@pytest.mark.parametrize("sizes, named", [(["1GiB", "2GiB"], "one per stage (--stages 3)"), (["lots"], "not a size")])
def test_run_memory_budget_refuses_what_it_cannot_use(sizes, named):
    from argparse import Namespace

    from layerbus.cli.errors import UsageError
    from layerbus.cli.run import stage_budgets

    with pytest.raises(UsageError, match=re.escape(named)):
        stage_budgets(Namespace(memory_budget=sizes, stages=3))
