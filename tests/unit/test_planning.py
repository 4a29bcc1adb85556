"""The broker's placement decisions as pure functions (planner.planning): literal tables, no stages."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from layerbus.planner.chain import Placement
from layerbus.planner.drift import Work
from layerbus.planner.partition import ModelCost
from layerbus.planner.placement import ModelMemory, PlacementError, PlanOptions, Shapes, StageProfile
from layerbus.planner.planning import (
    PlanInputs,
    expected_busy_s,
    link_codec_inputs,
    plan_chain,
    planned,
    profiles_of,
    replan_slowed,
    slowed_profile,
    unplanned_spans,
    unprofiled,
    without_stage,
)
from layerbus.planner.wire_choice import AutoWireInputs
from layerbus.wire.spans import LayerRange

SHAPES = Shapes(num_slots=4, micro_batch_size=2, num_micro_batches=3, max_context=8, max_step_tokens=4)
NO_PROMPTS = PlanOptions(prompt_tokens_per_new_token=0)
KEEP_ORDER = PlanOptions(prompt_tokens_per_new_token=0, allow_reorder=False)  # tables with one right order


def model(num_layers: int) -> ModelMemory:
    return ModelMemory(layer_weight_bytes=(100,) * num_layers, embed_bytes=200, head_bytes=220,
                       head_shares_embed=False, kv_bytes_per_token=1, activation_bytes_per_token=8, hidden_size=2,
                       intermediate_size=4, num_attention_heads=1, vocab_size=8, dtype_bytes=4)


def profile(name: str, layer: float, budget: int = 10**9, bandwidth: float = math.inf) -> StageProfile:
    return StageProfile(name, layer_decode_s=layer, layer_prefill_s=4 * layer, embed_s=0.0, head_s=0.0,
                        memory_budget=budget, link_bandwidth=bandwidth, micro_batch_size=SHAPES.micro_batch_size,
                        prefill_tokens=SHAPES.max_step_tokens)


def inputs(num_layers: int, options: PlanOptions = NO_PROMPTS) -> PlanInputs:
    return PlanInputs("tiny", model(num_layers), SHAPES, options)


def spans(*bounds: int) -> tuple[LayerRange, ...]:
    return tuple(LayerRange(a, b) for a, b in zip(bounds, bounds[1:]))


# -- the first plan and the plan after a lost stage --------------------------------------------------

@pytest.mark.parametrize("names, speeds, options, want_order, want_spans", [
    (["a", "b"], {"a": 1.0, "b": 1.0}, KEEP_ORDER, ("a", "b"), spans(0, 4, 8)),
    (["a", "b"], {"a": 1.0, "b": 3.0}, NO_PROMPTS, ("b", "a"), spans(0, 2, 8)),  # slow b gets fewer layers
    (["a", "b"], {"a": 1.0, "b": 4.0}, KEEP_ORDER, ("a", "b"), spans(0, 7, 8)),
    (["a", "b", "c"], {"a": 1.0, "b": 1.0, "c": 1.0}, KEEP_ORDER, ("a", "b", "c"), spans(0, 2, 4, 6)),
])
def test_plan_chain_places_every_named_stage(names, speeds, options, want_order, want_spans):
    layers = want_spans[-1].end
    plan = plan_chain(names, [profile(n, s) for n, s in speeds.items()], inputs(layers, options))
    assert (tuple(plan.order), tuple(plan.spans)) == (want_order, want_spans)
    assert planned(plan) == Placement(want_order, want_spans, (), "planned", plan)


def test_plan_chain_names_the_model_and_the_missing_profile():
    with pytest.raises(PlacementError, match="cannot place tiny: .* short"):
        plan_chain(["a"], [profile("a", 1.0, budget=100)], inputs(4))
    with pytest.raises(ValueError, match=r"no profile for stage\(s\) \['b'\]; profiled: \['a'\]"):
        plan_chain(["a", "b"], [profile("a", 1.0)], inputs(4))


@pytest.mark.parametrize("names, known, want", [
    (["a", "b"], [], ["a", "b"]),
    (["a", "b"], ["b"], ["a"]),
    (["a", "b"], ["a", "b", "z"], []),
])
def test_unprofiled_stages_are_the_ones_to_measure(names, known, want):
    assert unprofiled(names, [profile(n, 1.0) for n in known]) == want


def test_profiles_of_keeps_the_order_asked_for():
    assert [p.name for p in profiles_of(["c", "a"], [profile("a", 1.0), profile("c", 2.0)])] == ["c", "a"]


@pytest.mark.parametrize("lost, live, want_order, want_spans", [
    ("b", ["a", "c"], ("a", "c"), spans(0, 3, 6)),  # the survivors share the model
    ("a", ["b", "c", "new"], ("b", "c", "new"), spans(0, 2, 4, 6)),  # a stage that joined since is used
    ("a", ["a", "b", "c"], ("a", "b", "c"), spans(0, 2, 4, 6)),  # the lost one registered again: measured anew
])
def test_after_a_loss_the_survivors_are_planned_and_only_newcomers_measured(lost, live, want_order, want_spans):
    known = without_stage([profile(n, 1.0) for n in ("a", "b", "c")], lost)
    newcomers = unprofiled(live, known)
    assert newcomers == [n for n in live if n == lost or n == "new"]
    plan = plan_chain(live, [*known, *(profile(n, 1.0) for n in newcomers)], inputs(6, KEEP_ORDER))
    assert (tuple(plan.order), tuple(plan.spans)) == (want_order, want_spans)


def test_the_survivors_too_small_for_the_model_raise():
    # 1200 bytes hold 2 of the 6 layers (132 bytes each with their KV cache) plus an end and the
    # workspace, not 3: three stages fit, the two left after a loss do not.
    known = [profile(n, 1.0, budget=1200) for n in "abc"]
    assert len(plan_chain(["a", "b", "c"], known, inputs(6)).order) == 3
    with pytest.raises(PlacementError, match="cannot place tiny: the cluster is .* short"):
        plan_chain(["b", "c"], without_stage(known, "a"), inputs(6))


def test_without_stage_forgets_only_that_stage():
    assert [p.name for p in without_stage([profile("a", 1), profile("b", 1)], "a")] == ["b"]


def test_a_lost_stage_takes_the_co_run_factors_of_its_host_with_it():
    """Factors measured beside the lost stage overstate the sharing once it is gone: its host-mates plan
    from threads and cores again; stages elsewhere keep theirs."""
    def on(host: str, name: str, factor: float) -> StageProfile:
        return replace(profile(name, 1.0), host=host, host_cores=2, corun_factor=factor)

    known = [on("vm", "a", 1.0), on("vm", "b", 1.4), on("vm", "c", 1.76), on("box", "d", 1.2), on("box", "e", 1.3)]
    assert {p.name: p.corun_factor for p in without_stage(known, "b")} == {"a": 0.0, "c": 0.0, "d": 1.2, "e": 1.3}
    assert {p.name: p.corun_factor for p in without_stage(known, "nobody")} == {p.name: p.corun_factor for p in known}


def test_after_a_loss_two_identical_survivors_share_the_layers_evenly():
    """The bench_faults case: three single-thread stages on two cores measured 1.0x, 1.0x and 1.76x
    together. With the factors kept, the survivors' re-plan was lopsided; without, even."""
    def on_vm(name: str, factor: float) -> StageProfile:
        return replace(profile(name, 1.0), host="vm", host_cores=2, corun_factor=factor)

    known = [on_vm("a", 1.0), on_vm("b", 1.0), on_vm("c", 1.76)]
    plan = plan_chain(["a", "c"], without_stage(known, "b"), inputs(6, KEEP_ORDER))
    assert tuple(plan.spans) == spans(0, 3, 6)


# -- the split without profiles ------------------------------------------------------------------------

@pytest.mark.parametrize("partition, names, layers, costs, want_stages, want_spans", [
    ("equal", ["a", "b"], 6, None, ("a", "b"), spans(0, 3, 6)),
    ("equal", ["a", "b", "c"], 2, None, ("a", "b"), spans(0, 1, 2)),  # one layer per stage at most
    ("balanced", ["a", "b"], 4, ModelCost(layer=(3.0, 1.0, 1.0, 1.0)), ("a", "b"), spans(0, 1, 4)),
])
def test_unplanned_spans(partition, names, layers, costs, want_stages, want_spans):
    placement = unplanned_spans(partition, names, layers, costs)
    assert (placement.stages, placement.spans, placement.partition, placement.plan) == (
        want_stages, want_spans, partition, None)


def test_unplanned_spans_refuse_planned():
    with pytest.raises(ValueError, match="'planned' has no fixed split"):
        unplanned_spans("planned", ["a"], 2, None)


# -- re-planning a slowed stage --------------------------------------------------------------------------

def test_slowed_profile_slows_compute_not_links():
    slowed = slowed_profile(profile("a", 1.0, bandwidth=1e9), 3.0)
    assert (slowed.layer_decode_s, slowed.layer_prefill_s, slowed.link_bandwidth) == (3.0, 12.0, 1e9)


@pytest.mark.parametrize("slowed, min_gain, want_move, want_spans", [
    ({"b": 4.0}, 0.15, True, spans(0, 7, 8)),  # b at a quarter of its speed: 7 of 8 layers move to a
    ({"b": 1.1}, 0.15, False, None),  # a little slower: the best plan is not 15% faster
    ({"b": 4.0}, 0.9, False, None),  # would gain, but less than asked
])
def test_replan_slowed(slowed, min_gain, want_move, want_spans):
    current = Placement(("a", "b"), spans(0, 4, 8))
    decision = replan_slowed(slowed, current, ["a", "b"], [profile("a", 1.0), profile("b", 1.0)],
                             inputs(8, KEEP_ORDER), min_gain)
    assert decision.move is want_move
    assert [p.layer_decode_s for p in decision.profiles] == [1.0, slowed["b"]]  # kept slowed for later plans
    assert decision.current_step_s == pytest.approx(4 * slowed["b"])  # b's 4 layers at its slowed pace
    assert (tuple(decision.plan.spans) if decision.plan else None) == want_spans


@pytest.mark.parametrize("joiner_speed, min_gain, want_move, want_stages", [
    (1.0, 0.15, True, ("a", "b")),  # as fast as a: the 8 layers split 4 / 4, twice as fast
    (0.1, 0.15, False, None),  # ten times slower: even one layer on it is slower than a alone
    (1.0, 0.6, False, None),  # would gain half, but more is asked
])
def test_a_stage_that_joins_mid_job_is_used_when_the_plan_with_it_is_faster(joiner_speed, min_gain, want_move,
                                                                               want_stages):
    """Broker.grow's decision: the placement in use (a alone) against the best plan over every live stage,
    the one that joined included, with nothing slowed."""
    current = Placement(("a",), spans(0, 8))
    decision = replan_slowed({}, current, ["a", "b"], [profile("a", 1.0), profile("b", 1.0 / joiner_speed)],
                             inputs(8, KEEP_ORDER), min_gain)
    assert decision.current_step_s == pytest.approx(8.0)  # a's 8 layers at 1 s each
    assert decision.move is want_move
    assert (tuple(decision.plan.order) if decision.plan else None) == want_stages


def test_replan_slowed_keeps_an_unchanged_placement():
    current = Placement(("a", "b"), spans(0, 4, 8))
    decision = replan_slowed({"a": 1.0}, current, ["a", "b"], [profile("a", 1.0), profile("b", 1.0)],
                             inputs(8, KEEP_ORDER), 0.0)
    assert decision.best is not None and decision.plan is None  # the best plan is the one in use


def test_replan_slowed_leaves_out_stages_no_longer_live():
    current = Placement(("a", "b"), spans(0, 4, 8))
    decision = replan_slowed({"b": 4.0}, current, ["a", "b"], [profile(n, 1.0) for n in "abz"], inputs(8), 0.15)
    assert "z" not in decision.best.order


# -- pricing work ------------------------------------------------------------------------------------------

def test_expected_busy_s_prices_decode_prefill_and_head_by_the_stage_profile():
    two = [StageProfile("a", 1.0, 10.0, embed_s=0.5, head_s=0.0, memory_budget=10**9, step_overhead_s=0.1,
                        micro_batch_size=2, prefill_tokens=4),
           StageProfile("b", 1.0, 10.0, embed_s=0.0, head_s=2.0, memory_budget=10**9, micro_batch_size=2,
                        prefill_tokens=4)]
    plan = plan_chain(["a", "b"], two, inputs(4, KEEP_ORDER))
    assert plan.order == ["a", "b"] and plan.spans == list(spans(0, 3, 4))  # b's head costs it two layers
    work = Work(steps=3, decode_rows=4, prefill_tokens=8, emit_rows=6)  # 2 decode steps, 2 prefill chunks
    # a: 3 x 0.1 overhead + 3 layers x (2 x 1.0 + 2 x 10.0) + embed of 4 + 8 positions x 0.25. The
    # embedding is a lookup per position, so a prefill chunk of 4 tokens costs it twice a decode step
    # of 2 rows (priced as one profiled step both would be 4 x 0.5 = 2.0).
    assert expected_busy_s(plan, two, "a", work) == pytest.approx(0.3 + 66.0 + 3.0)
    # b: 1 layer x 22.0 + head for 6 emitted rows = 3 decode steps x 2.0
    assert expected_busy_s(plan, two, "b", work) == pytest.approx(22.0 + 6.0)
    assert expected_busy_s(plan, two, "z", work) == 0.0
    assert expected_busy_s(None, two, "a", work) == 0.0


# -- the links' codec inputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("wire, stages, want", [
    ("int8", ("a", "b", "c"), "int8"),
    (("int8", "float16"), ("a", "b", "c"), ("int8", "float16")),
    (("int8", "float16"), ("a", "b"), ("int8",)),  # fewer stages than configured: cut
    (("int8",), ("a", "b", "c"), ("int8", "int8")),  # more: the last codec repeated
])
def test_link_codec_inputs_fit_the_wire_setting_to_the_chain(wire, stages, want):
    placement = Placement(stages, spans(*range(len(stages) + 1)), partition="equal")
    got, auto = link_codec_inputs(wire, AutoWireInputs(), placement, [])
    assert got == want and auto == AutoWireInputs()


def test_link_codec_inputs_take_bandwidth_and_compute_from_a_plan():
    known = [profile("a", 1.0, bandwidth=1e9), profile("b", 2.0, bandwidth=2e9)]
    placement = planned(plan_chain(["a", "b"], known, inputs(4)))
    _, auto = link_codec_inputs("auto", AutoWireInputs(), placement, known)
    first = placement.stages[0]
    assert auto.link_bandwidth == ({"a": 1e9, "b": 2e9}[first],)
    assert auto.compute_s_per_step == pytest.approx(max(s.compute_s for s in placement.plan.stages))
