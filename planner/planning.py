"""The broker's placement decisions as pure functions of plain values: the first plan and the re-plan
after a lost stage (`without_stage`, then `plan_chain` over the stages left, measuring only those
`unprofiled`), the re-plan of a slowed stage, the split without profiles, the codec inputs
of each link and the price of the work sent to a stage. Profiles, memory needs and the placement in
use go in, values come out; measuring, loading spans, logging and events stay in the broker
(broker.py, with profiling.py for the measuring), which feeds these and acts on their answers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from layerbus.planner.chain import Placement
from layerbus.planner.drift import Work
from layerbus.planner.partition import balanced_partition, equal_partition
from layerbus.planner.step_cost import StepWork
from layerbus.planner.placement import (
    ModelMemory,
    PlacementError,
    Plan,
    PlanOptions,
    StageProfile,
    estimate_split,
    plan_placement,
)
from layerbus.planner.weight_choice import assigned_weights
from layerbus.planner.wire_choice import AutoWireInputs


@dataclass(frozen=True)
class PlanInputs:
    """What every plan of one broker depends on besides the stages' profiles."""

    model_name: str  # for messages ("cannot place SmolLM2-135M: ...")
    memory: ModelMemory  # the model's exact memory needs in the stages' dtype
    batching: object  # a resolved BatchingConfig (or placement.Shapes)
    options: PlanOptions = PlanOptions()
    job: object = None  # the job's windows (planner.workload.JobShape), None: a steady mix of decode and prefill
    # The links between stages (planner.network.LinkMatrix), for the first plan and every re-plan
    # alike; None: each stage's own measured link
    network: object = None


def plan_chain(names: Sequence[str], profiles: Sequence[StageProfile], inputs: PlanInputs) -> Plan:
    """The plan over the stages `names` (in this order where the order is kept), each with its
    profile in `profiles`. Raises PlacementError naming the model when they cannot hold it."""
    chosen = profiles_of(names, profiles)
    try:
        return plan_placement(chosen, inputs.memory, inputs.batching, inputs.options, inputs.job, inputs.network)
    except PlacementError as error:
        raise PlacementError(f"cannot place {inputs.model_name}: {error}") from None


def one_chain_planner(requested, memory: ModelMemory, options: PlanOptions, network=None, workload=None,
                      job_shape=None) -> Callable[[Sequence[StageProfile], tuple, int], Plan]:
    """What planner.chain_plan prices each grouping with: one chain over some stages, beside other chains'
    stages, with the batch sizes its broker would choose (batch_sizing.choose_by_plan from `requested`,
    a BatchingConfig, and its share of the job's `workload`, a planner.workload.Workload or None: as
    `run --chains K` gives each chain's broker). With a workload, `job_shape(workload, batching)` turns
    it into the windows the plan prices (the broker's simulation of its own scheduler,
    broker.job_simulation.job_shape)."""
    from layerbus.planner.batch_sizing import choose_by_plan
    from layerbus.planner.workload import mean_decode_context

    if workload is not None and workload.items and job_shape is None:
        raise ValueError("one_chain_planner: a workload needs job_shape, the function that turns it into windows")

    def plan_one(group, neighbours, chains: int = 1) -> Plan:
        share = workload.share(0, chains) if workload is not None else None
        items = share.items if share is not None else None

        def plan_for(batching) -> Plan:
            job = job_shape(share, batching) if items else None
            return plan_placement(group, memory, batching, options, job, network, neighbours)

        return choose_by_plan(requested, len(group), group, memory, plan_for, items, mean_decode_context(share),
                              options.reserve_fraction)[1]

    return plan_one


def profiles_of(names: Sequence[str], profiles: Sequence[StageProfile]) -> list[StageProfile]:
    """The profiles of `names`, in that order; ValueError naming those that have none."""
    by_name = {profile.name: profile for profile in profiles}
    missing = [name for name in names if name not in by_name]
    if missing:
        raise ValueError(f"no profile for stage(s) {missing}; profiled: {sorted(by_name)}")
    return [by_name[name] for name in names]


def unprofiled(names: Sequence[str], profiles: Sequence[StageProfile]) -> list[str]:
    """The stages of `names` to measure before planning (in order): those without a profile."""
    known = {profile.name for profile in profiles}
    return [name for name in names if name not in known]


def without_stage(profiles: Sequence[StageProfile], name: str) -> tuple[StageProfile, ...]:
    """The profiles less this stage's: a lost stage that registers again is measured anew. The stages
    that shared its host's cores lose their co-run factors too: those were measured beside it, and with
    one stage fewer competing they overstate the sharing (the plan then reckons it from threads and
    cores). Kept, they had a re-plan of two identical survivors give one of them 1 layer of 30: its
    factor of 1.76 came from three stages on two cores."""
    lost = next((profile for profile in profiles if profile.name == name), None)
    left = tuple(profile for profile in profiles if profile.name != name)
    if lost is None or not lost.shares_cores:
        return left
    return tuple(replace(profile, corun_factor=0.0, lockstep_excess_s=0.0)
                 if profile.shares_cores and profile.host == lost.host and profile.corun_factor > 0 else profile
                 for profile in left)


def unplanned_spans(partition: str, names: Sequence[str], num_layers: int, layer_costs) -> Placement:
    """The "balanced" (by FLOPs, `layer_costs` from partition.model_cost_from_config) or "equal"
    split over `names` in order; stages beyond one per layer are left out."""
    chain = tuple(names[:num_layers])
    if partition == "equal":
        spans = equal_partition(num_layers, len(chain))
    elif partition == "balanced":
        spans = balanced_partition(layer_costs, len(chain))
    else:
        raise ValueError(f"partition {partition!r} has no fixed split: it is 'balanced' or 'equal'")
    return Placement(chain, tuple(spans), partition=partition)


def planned(plan: Plan) -> Placement:
    """The placement a plan makes (its links' codecs are chosen afterwards: `with_codecs`)."""
    return Placement(tuple(plan.order), tuple(plan.spans), partition="planned", plan=plan)


def stage_weights(placement: Placement, broker_weights: str) -> list[str]:
    """The --weights each stage of the chain is told to hold: the plan's choice for the stages it chose
    for under auto (int8 or int4 where full precision did not fit), else the broker's flag (a stage's
    own --weights wins on the stage's side either way)."""
    if placement.plan is None:
        return [broker_weights] * len(placement.stages)
    chosen = {stage.name: stage for stage in placement.plan.stages}
    return [assigned_weights(chosen[name].requested_weights, chosen[name].weights) if name in chosen
            else broker_weights for name in placement.stages]


def slowed_profile(profile: StageProfile, factor: float) -> StageProfile:
    """The profile of the same stage running `factor` times slower (links unchanged)."""
    return profile.slowed(factor)


@dataclass(frozen=True)
class SlowedReplan:
    """What re-planning for slowed stages found."""

    profiles: tuple[StageProfile, ...]  # every profile, the slowed ones slowed: they stay so for later plans
    current_step_s: float  # the placement in use, priced with the slowed profiles
    best: Plan | None  # the best plan over the live stages (None: none fits)
    gain: float  # 1 - best / current step time (0 without a best plan)
    move: bool  # worth moving layers: at least `min_gain` faster and a different placement

    @property
    def plan(self) -> Plan | None:
        """The plan to move to, or None: layers stay."""
        return self.best if self.move else None


def replan_slowed(slowed: dict[str, float], current: Placement, live: Sequence[str],
                  profiles: Sequence[StageProfile], inputs: PlanInputs, min_gain: float) -> SlowedReplan:
    """Slow each stage of `slowed` ({name: factor}) by its factor, price the placement in use and the
    best plan over the `live` stages with those profiles, and say whether moving is worth it."""
    profiles = tuple(slowed_profile(p, slowed[p.name]) if p.name in slowed else p for p in profiles)
    in_use = estimate_split(profiles_of(current.stages, profiles), current.spans, inputs.memory,
                            inputs.batching, inputs.options, inputs.job, inputs.network)
    try:
        best = plan_chain([p.name for p in profiles if p.name in set(live)], profiles, inputs)
    except PlacementError:
        return SlowedReplan(profiles, in_use.step_s, None, 0.0, False)
    gain = 1 - best.step_s / in_use.step_s
    unchanged = tuple(best.spans) == tuple(current.spans) and tuple(best.order) == tuple(current.stages)
    return SlowedReplan(profiles, in_use.step_s, best, gain, gain >= min_gain and not unchanged)


def expected_busy_s(plan: Plan | None, profiles: Sequence[StageProfile], stage_name: str, work: Work) -> float:
    """What the stage's profile says `work` takes on its span of `plan`, with the plan's cost model
    (StageProfile.busy_s): per step its fixed cost, per decode row and prefill token its layers'
    share (attending over the plan's mean context), plus the embedding on the first stage and the
    head for each emitted row on the last. 0 when it is not in the plan (or there is none)."""
    placement = next((s for s in plan.stages if s.name == stage_name), None) if plan is not None else None
    profile = next((p for p in profiles if p.name == stage_name), None)
    if placement is None or profile is None:
        return 0.0
    total = plan.chosen_work
    kv_per_row = total.decode_kv / total.decode_rows if total.decode_rows else 0.0
    ctx_per_token = total.prefill_ctx / total.prefill_tokens if total.prefill_tokens else 0.0
    passes_per_step = total.passes / total.steps if total.steps else 1.0
    emit_share = total.emit_steps / total.steps if total.steps else 1.0
    step_work = StepWork(steps=work.steps, passes=work.steps * passes_per_step, decode_rows=work.decode_rows,
                         decode_kv=work.decode_rows * kv_per_row, prefill_tokens=work.prefill_tokens,
                         prefill_ctx=work.prefill_tokens * ctx_per_token,
                         emit_steps=min(work.steps * emit_share, work.emit_rows), emit_rows=work.emit_rows)
    return profile.busy_s(step_work, len(placement.layers), placement.is_first, placement.is_last)


def link_codec_inputs(wire: tuple[str, ...] | str, auto: AutoWireInputs, placement: Placement,
                      profiles: Sequence[StageProfile]) -> tuple[tuple[str, ...] | str, AutoWireInputs]:
    """(the wire setting, the auto inputs) for the links of `placement`. A per-link list given for the
    configured chain is cut (or its last codec repeated) when the chain has fewer or more stages;
    `auto` takes each link's bandwidth and the step time from the profiles when they were measured."""
    links = len(placement.stages) - 1
    if not isinstance(wire, str) and len(wire) != links:
        wire = tuple(wire[i] if i < len(wire) else wire[-1] for i in range(links))
    if placement.plan is not None:
        by_name = {profile.name: profile for profile in profiles}
        if not auto.link_bandwidth and all(name in by_name for name in placement.stages):
            auto = replace(auto, link_bandwidth=tuple(by_name[name].link_bandwidth for name in placement.stages[:-1]))
        if auto.compute_s_per_step is None:
            auto = replace(auto, compute_s_per_step=max(s.compute_s for s in placement.plan.chosen.stages))
    return wire, auto
