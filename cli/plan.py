"""`layerbus plan`: how the model would be placed, for a cluster described in a file (`--cluster`) or
for N local stages that profile themselves (`--stages N`, with emulated speeds and budgets)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerbus.cli.errors import EXIT_OK, UsageError
from layerbus.cli.options import (
    add_cluster_options,
    add_model,
    add_weights,
    batching_from_args,
    checked_stage_flag,
    command_parser,
    non_negative_float,
    non_negative_int,
    positive_int,
    resolve_model,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "plan", main, help="show how the model's layers would be placed on a cluster",
                        description="Plan the placement of the model's layers: per stage its layers, "
                                    "weight and KV bytes and predicted ms per step; the predicted tokens/s "
                                    "and bubble, beside the equal split's. For a cluster described in a "
                                    "file (--cluster, JSON or TOML, see docs/placement.md) or for N local stages "
                                    "that profile themselves (--stages N).") as parser:
        add_model(parser, "Hugging Face model directory (default: SmolLM2-135M-Instruct)")
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--cluster", metavar="FILE", help="cluster description (.json or .toml)")
        source.add_argument("--stages", metavar="N", type=positive_int, help="start N local stages and profile them")
        parser.add_argument("--threads-per-stage", metavar="N", type=non_negative_int, default=0,
                            help="local stages: torch threads each (default: the cores shared evenly)")
        parser.add_argument("--emulate-speed", metavar="F", nargs="+", default=[],
                            help="local stages: emulated speed of stage 0, 1, ... (0 < F <= 1; missing = 1)")
        parser.add_argument("--memory-budget", metavar="SIZE", nargs="+", default=[],
                            help="local stages: memory budget of stage 0, 1, ..., each its whole memory, runtime "
                                 "included (300MB, 1.5GiB; '-' = free memory)")
        parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                            help="the stages' dtype (default: float32)")
        parser.add_argument("--prompt-ratio", metavar="R", type=non_negative_float, default=1.0,
                            help="prompt tokens per generated token in the workload (default: 1)")
        parser.add_argument("--keep-order", action="store_true", help="keep the stages in the given order")
        parser.add_argument("--keep-all", action="store_true", help="give every stage layers, even a slow one")
        parser.add_argument("--chains", metavar="K", type=non_negative_int, default=0,
                            help="chains the stages form, each holding the whole model and working the job beside the "
                                 "others (default: 0 = the number predicted fastest, shown beside one chain of all)")
        parser.add_argument("--json", action="store_true", help="print the plan as JSON")
        parser.add_argument("--explain", action="store_true",
                            help="show per stage why it does not use all its memory (weights, KV, workspace, reserve), "
                                 "and the chain's hosts and the links it crosses")
        parser.add_argument("--quality", metavar="FILE", type=Path, default=None,
                            help="a `layerbus quality --json` report of this model: --explain and --json then give "
                                 "each quantized stage's cost in quality from it (default: SmolLM2-135M's, built in)")
        add_cluster_options(parser, partition=False)
        add_weights(parser, stage_files=True)


def main(args: argparse.Namespace) -> int:
    from layerbus.planner.model_memory import model_memory
    from layerbus.planner.placement import PlanOptions, Shapes, plan_placement
    from layerbus.planner.plan_report import format_explain, format_plan
    from layerbus.models.model_info import read_model_info

    if args.cluster and (args.emulate_speed or args.memory_budget or args.threads_per_stage):
        raise UsageError("--emulate-speed, --memory-budget and --threads-per-stage are for local --stages; "
                         "describe the devices in the --cluster file instead")
    model_dir = resolve_model(args.model)
    quality = _quality_table(args.quality, Path(model_dir).name)  # read first: a bad file costs no profiling
    info = read_model_info(model_dir)
    batching = batching_from_args(args)
    memory = model_memory(info.files, args.dtype)
    options = PlanOptions(prompt_tokens_per_new_token=args.prompt_ratio, allow_reorder=not args.keep_order,
                          allow_drop=not args.keep_all)
    from dataclasses import replace

    from layerbus.planner.batch_sizing import choose_by_plan

    batching = replace(batching, max_context=min(batching.max_context, info.max_positions))
    network = None
    if args.cluster:
        from layerbus.planner.cluster_file import read_cluster
        from layerbus.planner.partition import model_cost_from_config

        count = _count_stages(args.cluster)
        cluster = read_cluster(args.cluster, model_cost_from_config(info.files.config),
                               Shapes.from_batching(batching.resolved(count), count))
        # A stage's own `weights` in the file wins over --weights, as a stage's own flag does.
        profiles = [p if p.weights != "auto" else replace(p, weights=args.weights) for p in cluster.profiles]
        network = cluster.network
    else:
        count = args.stages
        profiles, network = _local_profiles(model_dir, memory, batching, args)
        profiles = [replace(p, weights=args.weights) for p in profiles]
    # Sizes left at 0 are chosen from the profiles, as the broker chooses them (no job: no item cap).
    sizing, plan = choose_by_plan(
        batching, count, profiles, memory,
        lambda chosen: plan_placement(profiles, memory, Shapes.from_batching(chosen, count), options,
                                      network=network),
        reserve_fraction=options.reserve_fraction)
    chains = _plan_chains(profiles, memory, batching, options, network, args.chains)
    if args.json:
        report = dict(plan.to_json(), chains=chains.to_json())
        for stage in report["chosen"]["stages"]:
            cost = quality.formats.get(stage["weights"])
            stage["quality_vs_float32"] = (None if cost is None or stage["weights"] == "fp32" else
                                           {"mean_kl": cost[0], "same_top": cost[1], "source": quality.source})
        print(json.dumps(dict(report, batching_reasons=list(sizing.reasons)), indent=2))
    else:
        from layerbus.planner.plan_report import format_chains

        print(format_plan(plan))
        print(format_chains(chains))
        if args.explain:
            print("batch sizes:")
            print("\n".join(f"  {reason}" for reason in sizing.reasons))
            print(format_explain(plan, quality))
    return EXIT_OK


def _plan_chains(profiles, memory, batching, options, network, chains: int):
    """The grouping of the stages into chains (planner/chain_plan.py), each chain's batch sizes chosen from
    its own stages' profiles, as that chain's broker would."""
    from layerbus.planner.chain_plan import ChainPlanOptions, plan_chains
    from layerbus.planner.placement import PlacementError
    from layerbus.planner.planning import one_chain_planner

    try:
        return plan_chains(profiles, one_chain_planner(batching, memory, options, network),
                           ChainPlanOptions(chains=chains))
    except PlacementError as error:
        raise UsageError(f"--chains {chains}: {error}") from None


def _quality_table(path: Path | None, model_name: str):
    from layerbus.planner.weight_choice import BUILT_IN_QUALITY, quality_from_report

    if path is None:
        return BUILT_IN_QUALITY
    try:
        report = json.loads(path.read_text())
    except OSError as error:
        raise UsageError(f"--quality {path}: {error.strerror or error}; make it with `layerbus quality --json > {path}`")
    except ValueError as error:
        raise UsageError(f"--quality {path}: not JSON ({error}); make it with `layerbus quality --json > {path}`")
    try:
        return quality_from_report(report, model_name, str(path))
    except ValueError as error:
        raise UsageError(f"--quality {error}") from None


def _count_stages(path: str) -> int:
    """The number of stages in the file, for the batching defaults (slots scale with stages); a
    broken file is reported properly by read_cluster_file."""
    from layerbus.planner.cluster_file import ClusterFileError, _parse
    from pathlib import Path

    try:
        stages = _parse(Path(path), Path(path).read_text()).get("stages")
    except (OSError, ClusterFileError):
        return 1
    return len(stages) if isinstance(stages, list) and stages else 1


def _local_profiles(model_dir, memory, batching, args):
    from layerbus.broker.broker import BrokerConfig
    from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
    from layerbus.broker.profiling import collect_profiles

    if len(args.emulate_speed) > args.stages or len(args.memory_budget) > args.stages:
        raise UsageError(f"--emulate-speed/--memory-budget list more values than --stages {args.stages}")
    stage_args = []
    for i in range(args.stages):
        extra = ["--dtype", args.dtype]
        if i < len(args.emulate_speed):
            extra += checked_stage_flag("--emulate-speed", args.emulate_speed[i])
        if i < len(args.memory_budget) and args.memory_budget[i] != "-":
            extra += checked_stage_flag("--memory-budget", args.memory_budget[i])
        stage_args.append(tuple(extra))
    config = BrokerConfig(str(model_dir), args.stages, batching=batching)
    cluster = LocalCluster(config, LocalStageOptions(threads_per_stage=args.threads_per_stage,
                                                     stage_args=tuple(stage_args)))
    try:
        broker = cluster.spawn()
        stages = sorted(broker.control.wait_for_stages(args.stages, 120.0), key=lambda s: s.name)
        print(f"layerbus plan: profiling {args.stages} local stage(s)...", file=sys.stderr, flush=True)
        profiles = collect_profiles(broker.control, stages, str(model_dir), memory,
                                    broker.batching.micro_batch_size, broker.batching.max_step_tokens,
                                    broker.max_context, weights=args.weights)
        # The links between the stages, as a broker times them (`--explain` says each figure is measured).
        broker.profiles = tuple(profiles)
        broker.time_links(stages)
        return profiles, broker.link_matrix(stages)
    finally:
        cluster.close()
