"""Placement on mismatched stages: planned split against the equal split, on one machine
with emulated devices.

A. SmolLM2, 2 local stages with one thread each, emulated speeds 1.0 (stage-0) and 0.33 (stage-1).
   The equal split puts layers [15, 30) and the LM head on the slow stage. Targets: planned tokens/s
   >= 2.0x the equal split's, and within 15% of the plan's own prediction.
B. 3 stages (all at emulated speed 0.33, so three stage processes fit this machine's 2 cores), one
   with a memory budget for only a few layers. Targets: the plan respects the budget and beats the
   best equal split that fits (equal layer counts over any ordered subset of the stages).

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_placement.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import tokenized_prompts  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.planner.partition import equal_partition  # noqa: E402
from layerbus.planner.placement import PlanOptions, estimate_split  # noqa: E402
from layerbus.planner.plan_report import format_plan  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run(model_dir: Path, prompts, max_new_tokens: int, batching: BatchingConfig, partition: str,
        stage_args: list[tuple[str, ...]], options: PlanOptions) -> dict:
    requests = [GenerationRequest(pid, ids, max_new_tokens=max_new_tokens) for pid, ids in prompts]
    config = BrokerConfig(str(model_dir), len(stage_args), partition=partition, batching=batching,
                          plan_options=options)
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1, stage_args=tuple(stage_args))) as cluster:
        broker = cluster.broker
        chain = [(stage.name, str(span)) for stage, span in zip(broker.chain, broker.spans)]
        plan, profiles = broker.plan, list(broker.profiles)
        started = time.perf_counter()
        results, stats = broker.generate(requests)
        wall = time.perf_counter() - started
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    new = sum(len(r.token_ids) for r in results)
    measured_ms = {name: 1000 * s["busy_s"] / s["steps"] for name, s in stats.stage_stats.items() if s.get("steps")}
    row = {"partition": partition, "chain": chain, "new_tokens": new, "wall_s": wall, "tok_s": new / wall,
           "steps": stats.steps, "measured_ms_per_step": measured_ms, "profiles": profiles}
    if plan is not None:
        row["plan"] = plan.to_json()
        row["predicted_tok_s"] = plan.tokens_per_s
        row["predicted_ms_per_step"] = {name: 1000 * s for name, s in plan.predicted_step_s.items()}
        print(format_plan(plan))
    return row


def best_fitting_equal_split(profiles, memory, shapes, options):
    """The equal split (any ordered subset of the stages) with the best predicted tokens/s that fits."""
    best = None
    for k in range(1, len(profiles) + 1):
        for chain in itertools.permutations(profiles, k):
            estimate = estimate_split(chain, equal_partition(memory.num_layers, k), memory, shapes, options)
            if estimate.fits and (best is None or estimate.tokens_per_s > best.tokens_per_s):
                best = estimate
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=768)
    parser.add_argument("--small-budget", default="300MB", help="scenario B: the small stage's memory budget")
    parser.add_argument("--skip", choices=["A", "B"], default=None)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_placement.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer

    model_dir = args.model or default_model_dir()
    prompts = tokenized_prompts(load_tokenizer(model_dir), args.prompts)
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    # What the planner is told about the workload: every prompt token is prefilled, and each item
    # may generate up to max_new_tokens (outputs that end early at EOS make the real ratio higher).
    options = PlanOptions(prompt_tokens_per_new_token=prompt_tokens / (len(prompts) * args.max_new_tokens))
    report = {"model": str(model_dir), "prompts": len(prompts), "prompt_tokens": prompt_tokens,
              "max_new_tokens": args.max_new_tokens, "micro_batch_size": args.micro_batch_size,
              "max_context": args.max_context, "prompt_tokens_per_new_token": options.prompt_tokens_per_new_token}

    if args.skip != "A":
        batching = BatchingConfig(micro_batch_size=args.micro_batch_size, max_context=args.max_context)
        stage_args = [("--emulate-speed", "1.0"), ("--emulate-speed", "0.33")]
        equal = run(model_dir, prompts, args.max_new_tokens, batching, "equal", stage_args, options)
        planned = run(model_dir, prompts, args.max_new_tokens, batching, "planned", stage_args, options)
        report["A"] = {"equal": equal, "planned": planned, "speedup": planned["tok_s"] / equal["tok_s"],
                       "vs_prediction": planned["tok_s"] / planned["predicted_tok_s"] - 1,
                       "equal_predicted_tok_s": planned["plan"]["equal"]["tokens_per_s"]}

    if args.skip != "B":
        batching = BatchingConfig(micro_batch_size=args.micro_batch_size, num_micro_batches=4,
                                  max_context=args.max_context)
        speeds = ("--emulate-speed", "0.33")
        stage_args = [speeds, (*speeds, "--emulate-memory", args.small_budget), speeds]
        planned = run(model_dir, prompts, args.max_new_tokens, batching, "planned", stage_args, options)
        from layerbus.planner.model_memory import model_memory
        from layerbus.planner.placement import Shapes
        from layerbus.models.model_info import read_model_info

        memory = model_memory(read_model_info(model_dir).files)
        shapes = Shapes(**planned["plan"]["shapes"])
        small = next(s for s in planned["plan"]["chosen"]["stages"] if s["name"] == "stage-1")
        # The best equal split that fits, judged on the same profiles the plan used.
        best = best_fitting_equal_split(planned["profiles"], memory, shapes, options)
        order = [s.name for s in best.stages]
        equal_args = [stage_args[int(name.split("-")[1])] for name in order]
        equal = run(model_dir, prompts, args.max_new_tokens, batching, "equal", equal_args, options)
        equal["stands_for"] = order
        equal["predicted_tok_s"] = best.tokens_per_s
        report["B"] = {"planned": planned, "best_fitting_equal": equal, "small_stage": small,
                       "budget_respected": small["free_bytes"] >= 0,
                       "speedup": planned["tok_s"] / equal["tok_s"],
                       "vs_prediction": planned["tok_s"] / planned["predicted_tok_s"] - 1}

    for scenario in ("A", "B"):
        for row in report.get(scenario, {}).values():
            if isinstance(row, dict) and "profiles" in row:
                row["profiles"] = [asdict(p) for p in row["profiles"]]  # nested: its step costs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{len(prompts)} prompts ({prompt_tokens} prompt tokens), up to {args.max_new_tokens} new tokens each, "
          f"micro-batches of {args.micro_batch_size}, one thread per stage")
    print("| scenario | split | chain (stage layers) | tok/s measured | tok/s predicted | measured ms/step per stage |")
    print("|---|---|---|---|---|---|")
    for name, scenario in (("A", report.get("A")), ("B", report.get("B"))):
        if not scenario:
            continue
        for key in ("equal", "best_fitting_equal", "planned"):
            row = scenario.get(key)
            if row is None:
                continue
            chain = ", ".join(f"{n} {s}" for n, s in row["chain"])
            predicted = f"{row['predicted_tok_s']:.1f}" if "predicted_tok_s" in row else "-"
            ms = ", ".join(f"{v:.0f}" for v in row["measured_ms_per_step"].values())
            print(f"| {name} | {key} | {chain} | {row['tok_s']:.1f} | {predicted} | {ms} |")
        print(f"| {name} | planned / equal | | {scenario['speedup']:.2f}x | | planned vs its prediction "
              f"{scenario['vs_prediction']:+.0%} |")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
