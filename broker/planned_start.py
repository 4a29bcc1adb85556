"""The broker's start-up with a planned placement: profile the registered stages, plan, order the
chain. Kept apart from broker.py so the planning steps read in one place."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from broker.control import StageInfo
from broker.model_memory import model_memory
from broker.placement import Plan, PlacementError, StageProfile, plan_placement
from broker.plan_report import format_plan
from broker.profiling import collect_profiles

if TYPE_CHECKING:
    from broker.broker import Broker

log = logging.getLogger("layerbus.broker")


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
