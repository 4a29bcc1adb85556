"""`layerbus run --chains auto`: profile the local stages once and let the planner group them into chains
(planner/chain_plan.py) before the run starts them in that shape.

The stages are started, profiled and stopped here, then started again by the run (one chain: as
`layerbus run` always does; several: one broker process per chain, launch/chains.py). Their profiles and
co-run factors are cached on disk by then, so the second start measures nothing again; the price is
the stages' second start-up (importing torch and loading a span: seconds each on this machine).
"""

from __future__ import annotations

import sys

from layerbus.broker.broker import BrokerConfig
from layerbus.planner.chain_plan import ChainsPlan, plan_chains
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.jobs.chain_split import ChainStages, split_sizes


def choose_local_chains(config: BrokerConfig, options: LocalStageOptions) -> ChainsPlan:
    """The planner's grouping of config.num_stages local stages (each profiled as a run's broker profiles
    them, at the run's batch sizes and with its job's workload); raises ClusterError when the stages
    do not all register and PlacementError when no grouping holds the model."""
    cluster = LocalCluster(config, options)
    try:
        broker = cluster.spawn()
        print(f"layerbus: --chains auto: profiling {config.num_stages} local stage(s) to choose the chains...",
              file=sys.stderr, flush=True)
        stages = broker.control.wait_for_stages(config.num_stages, config.register_timeout_s)
        broker.profile(stages)
        plan_one = broker.chain_planner(stages)
        profiles = list(broker.profiles)
    finally:
        cluster.close()
    return plan_chains(profiles, plan_one)


def chains_of(plan: ChainsPlan) -> list[ChainStages]:
    """The chosen grouping as `--chains K` runs it: consecutive stages, each chain as many as the planner
    put in it (stages its plan leaves out included: that chain's broker leaves them out again)."""
    return split_sizes([len(p.order) + len(p.left_out) for p in plan.chosen.plans])


def dealt_as_planned(plan: ChainsPlan) -> bool:
    """True when chains_of runs the planner's own groups: each chain's stages are consecutive (always so
    for alike stages, which the planner groups in order); else it runs the planner's sizes in order."""
    dealt = chains_of(plan)
    return all({f"stage-{i}" for i in chain.stages} == set(p.order) | set(p.left_out)
               for chain, p in zip(dealt, plan.chosen.plans))


def describe(plan: ChainsPlan) -> str:
    """A line for stderr: the choice and its prediction beside one chain's."""
    chosen = plan.chosen
    groups = " | ".join(" -> ".join(group) for group in chosen.groups)
    single = f"; one chain of all: {plan.single.tokens_per_s:.1f}" if plan.single and chosen.chains > 1 else ""
    line = (f"layerbus: --chains auto: {chosen.chains} chain(s) ({groups}), {chosen.tokens_per_s:.1f} tok/s "
            f"predicted{single}")
    if not dealt_as_planned(plan):
        line += ("; the stages are dealt into chains of those sizes in order (stage-0 first), which is not "
                 "the planner's grouping: pin --chains K, or give stages in the order they should group")
    return line
