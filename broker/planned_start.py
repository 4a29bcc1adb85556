"""The broker's planned placements: at start-up (profile the registered stages, plan, order the
chain), after a lost stage (the survivors' profiles are reused), and when a stage has slowed (its
profile is slowed by the measured factor and the plan is made again). Kept apart from broker.py so
the planning steps read in one place."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from layerbus.broker.control import StageInfo
from layerbus.broker.model_memory import model_memory
from layerbus.broker.placement import Plan, PlacementError, StageProfile, estimate_split, plan_placement
from layerbus.broker.plan_report import format_plan
from layerbus.broker.profiling import collect_profiles

log = logging.getLogger("layerbus.broker")

# The functions below read (and replan_slowed sets) attributes of the Broker. Its class is not
# imported, not even for type checking: broker.py imports this module, and modules import one way.
Broker = Any


def plan_chain(broker: Broker, stages: list[StageInfo],
               known: list[StageProfile] = ()) -> tuple[list[StageProfile], Plan, list[StageInfo]]:
    """(profiles of all stages, the plan, the chain in plan order). Stages the plan leaves out stay
    registered and idle. Stages with a profile in `known` (a re-plan) are not measured again."""
    dtypes = {stage.dtype for stage in stages}
    if len(dtypes) > 1:
        log.warning("stages run different dtypes %s; memory is planned for %s", sorted(dtypes), stages[0].dtype)
    memory = model_memory(broker.model.files, stages[0].dtype)
    batching = broker.batching
    known_by_name = {profile.name: profile for profile in known}
    new = [stage for stage in stages if stage.name not in known_by_name]
    measured = collect_profiles(broker.control, new, str(broker.model.path), memory, batching.micro_batch_size,
                                batching.max_step_tokens, broker.max_context, broker.config.profiling) if new else []
    known_by_name.update((profile.name, profile) for profile in measured)
    profiles = [known_by_name[stage.name] for stage in stages]
    try:
        plan = plan_placement(profiles, memory, batching, broker.config.plan_options)
    except PlacementError as error:
        raise PlacementError(f"cannot place {broker.model.path.name}: {error}") from None
    for line in format_plan(plan).splitlines():
        log.info("%s", line)
    by_name = {stage.name: stage for stage in stages}
    return profiles, plan, [by_name[name] for name in plan.order]


def slowed_profile(profile: StageProfile, factor: float) -> StageProfile:
    """The profile of the same stage running `factor` times slower (links unchanged)."""
    return replace(profile, layer_decode_s=profile.layer_decode_s * factor,
                   layer_prefill_s=profile.layer_prefill_s * factor, embed_s=profile.embed_s * factor,
                   head_s=profile.head_s * factor, step_overhead_s=profile.step_overhead_s * factor)


def replan_slowed(broker: Broker, slowed: dict[str, float]) -> Plan | None:
    """The plan for the stages as they run now, if it beats the placement in use by
    `drift.min_gain`; None otherwise. The slowed stages' profiles stay slowed for later plans."""
    broker.profiles = [slowed_profile(p, slowed[p.name]) if p.name in slowed else p for p in broker.profiles]
    memory = model_memory(broker.model.files, broker.chain[0].dtype)
    by_name = {profile.name: profile for profile in broker.profiles}
    live = {stage.name for stage in broker.control.live_stages()}
    current = estimate_split([by_name[s.name] for s in broker.chain], broker.spans, memory, broker.batching,
                             broker.config.plan_options)
    try:
        plan = plan_placement([p for p in broker.profiles if p.name in live], memory, broker.batching,
                              broker.config.plan_options)
    except PlacementError:
        return None
    gain = 1 - plan.step_s / current.step_s
    log.info("slowed %s: placement in use %.1f ms per step, best plan %.1f ms (%.0f%% faster)",
             slowed, current.step_s * 1e3, plan.step_s * 1e3, gain * 100)
    unchanged = plan.spans == broker.spans and plan.order == [stage.name for stage in broker.chain]
    if gain < broker.config.pipeline.drift.min_gain or unchanged:
        return None
    for line in format_plan(plan).splitlines():
        log.info("%s", line)
    return plan


def expected_busy_s(broker: Broker, stage_name: str, work) -> float:
    """What the stage's profile says `work` (broker.drift.Work) takes on its span of the plan in use:
    per step its fixed cost, per decode row and prefill token its layers' share, plus the embedding
    on the first stage and the head for each emitted row on the last. 0 when it is not in the plan."""
    placement = next((stage for stage in broker.plan.chosen.stages if stage.name == stage_name), None) \
        if broker.plan is not None else None
    profile = next((p for p in broker.profiles if p.name == stage_name), None)
    if placement is None or profile is None:
        return 0.0
    decode_steps = work.decode_rows / profile.micro_batch_size  # in units of the profiled decode step
    prefill_chunks = work.prefill_tokens / profile.prefill_tokens
    layers = placement.layers.end - placement.layers.start
    busy = work.steps * profile.step_overhead_s
    busy += layers * (decode_steps * profile.layer_decode_s + prefill_chunks * profile.layer_prefill_s)
    if placement.is_first:
        busy += (decode_steps + prefill_chunks) * profile.embed_s
    if placement.is_last:
        busy += work.emit_rows / profile.micro_batch_size * profile.head_s
    return busy
