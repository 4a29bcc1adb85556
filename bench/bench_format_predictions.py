"""Does the plan price a quantized stage at its own speed (a stage's profile is taken in its weight
format)? Predicted against measured busy time per step, per stage, on two fresh local stages of
one thread each under `--weights auto`:

  fp32    budgets that hold the model in float32: both stages full precision
  int8    budgets too small for float32: the planner quantizes both spans to int8
  int4    budgets too small for int8 too: both spans in int4

Each quantized case's budget is found by trying: from above the next larger format's need, 24 MiB less
each time until the plan holds both spans in the case's format.

The model has the 1.28B test model's matmul shapes (hidden 2048, MLP 5952: where this CPU's 4-bit tiles
run several times slower than float32) with 6 layers instead of 24, so both cases run in minutes. For the
int4 case the same plan is also priced as before this change (every format at the full-precision
profile's speed): the prediction the planner made when profiles were taken in full precision only.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_format_predictions.py   # about 5 minutes

Prints a table and writes bench/results/bench_format_predictions.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerbus.models.openmp_waits import prefer_passive_waits  # noqa: E402

prefer_passive_waits()  # before torch loads: this process is the broker (bench/__init__.py)

from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.planner.model_memory import model_memory  # noqa: E402
from layerbus.planner.placement import estimate_split  # noqa: E402
from layerbus.broker.profiling import ProfilingConfig  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.models.model_files import open_model_dir  # noqa: E402
from tests.helpers.large_model import make_large_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_format_predictions.json"
MIB = 1 << 20
RUNTIME_ALLOWANCE = 520 * MIB  # a stage's runtime (about 400 MiB) and its loader's temporary, with room


def half_bytes(memory, name: str) -> int:
    """What one stage of two holds in format `name`: half the layers and the embedding (tied head)."""
    sizes = memory.weights_in(name)
    return sum(sizes.layer_weight_bytes) // 2 + sizes.embed_bytes


class WrongFormat(Exception):
    """The plan chose another format than the case wants: try another budget."""


def run_case(model_dir: Path, budget: int, batching: BatchingConfig, prompts: int, new_tokens: int,
             want: str) -> dict:
    requests = [GenerationRequest(f"p{i}", [3 + (i * 7 + k) % 50 for k in range(12)], max_new_tokens=new_tokens)
                for i in range(prompts)]
    config = BrokerConfig(str(model_dir), 2, weights="auto", batching=batching,
                          profiling=ProfilingConfig(probe_s=0))  # the co-run factor is not what this measures
    stage_args = (("--memory-budget", str(budget)),) * 2
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1, fork=False, stage_args=stage_args)) as cluster:
        broker = cluster.broker
        chosen = [s.weights for s in broker.plan.stages]
        if chosen != [want] * len(chosen):
            raise WrongFormat(f"budget {budget / MIB:.0f} MiB: the plan holds {chosen}")
        began = time.perf_counter()
        results, _ = broker.generate(requests)
        wall = time.perf_counter() - began
        plan, report = broker.plan, broker.last_prediction
        inputs = broker.keeper.plan_inputs(broker.chain)
        chain = [p for name in plan.order for p in broker.profiles if p.name == name]
        # The same chain and split priced as before: every format at the full-precision profile's speed.
        unpriced = estimate_split([replace(p, format_layer_costs=()) for p in chain], plan.spans, inputs.memory,
                                  broker.batching, plan.options, inputs.job, inputs.network)
        stages = []
        for placed, old in zip(plan.stages, unpriced.stages):
            measured = report["stages"][placed.name]["measured_ms_per_step"]
            stages.append({"name": placed.name, "layers": str(placed.layers), "weights": placed.weights,
                           "format_speed": placed.format_speed, "predicted_ms": round(1000 * placed.step_s, 2),
                           "predicted_as_full_precision_ms": round(1000 * old.step_s, 2),
                           "measured_ms": round(measured, 2) if measured else None})
    tokens = sum(len(r.token_ids) for r in results)
    return {"budget_mib": round(budget / MIB), "tokens": tokens, "wall_s": round(wall, 2),
            "predicted_tok_s": round(plan.tokens_per_s, 2), "predicted_as_full_precision_tok_s": round(unpriced.tokens_per_s, 2),
            "measured_tok_s": round(report["measured_tok_s"], 2), "stages": stages}


def run_in_format(model_dir: Path, start_budget: int, batching: BatchingConfig, prompts: int, new_tokens: int,
                  want: str, tries: int = 8) -> dict:
    budget = start_budget
    for _ in range(tries):
        try:
            return run_case(model_dir, budget, batching, prompts, new_tokens, want)
        except WrongFormat as wrong:
            print(f"{want}: {wrong}; trying 24 MiB less", file=sys.stderr)
            budget -= 24 * MIB
    raise SystemExit(f"no budget from {start_budget / MIB:.0f} MiB down put both spans in {want}")


def error(predicted: float, measured: float | None) -> str:
    return f"{100 * (predicted - measured) / measured:+.0f}%" if measured else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--cases", nargs="*", default=["fp32", "int8", "int4"], choices=["fp32", "int8", "int4"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    batching = BatchingConfig(num_slots=args.prompts, micro_batch_size=args.prompts // 2, max_step_tokens=64,
                              max_context=128)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_large_model(Path(tmp) / "wide", num_layers=args.layers)
        memory = model_memory(open_model_dir(model_dir), "float32")
        int4, int8, fp32 = (half_bytes(memory, name) for name in ("int4", "int8", "fp32"))
        # Each case starts above the next larger format's weights: the search comes down from there.
        cases = {"fp32": RUNTIME_ALLOWANCE + 2 * fp32, "int8": RUNTIME_ALLOWANCE + fp32,
                 "int4": RUNTIME_ALLOWANCE + int8}
        out = {"model": f"1.28B shapes, {args.layers} layers", "prompts": args.prompts, "new_tokens": args.new_tokens,
               "weights_mib": {"fp32": round(fp32 / MIB), "int8": round(int8 / MIB), "int4": round(int4 / MIB)},
               "cases": {}}
        for name, budget in cases.items():
            if name in args.cases:
                out["cases"][name] = run_in_format(model_dir, budget, batching, args.prompts, args.new_tokens, name)
    print(f"{'case':<6} {'stage':<8} {'weights':<7} {'format speed':>12} {'predicted ms/step':>17} {'as fp (old)':>11} "
          f"{'measured':>9} {'error':>6} {'old error':>9}")
    for name, case in out["cases"].items():
        for s in case["stages"]:
            speed = f"{s['format_speed']:.2f}x" if s["format_speed"] else "-"
            print(f"{name:<6} {s['name']:<8} {s['weights']:<7} {speed:>12} {s['predicted_ms']:>17.1f} "
                  f"{s['predicted_as_full_precision_ms']:>11.1f} {s['measured_ms'] or 0:>9.1f} "
                  f"{error(s['predicted_ms'], s['measured_ms']):>6} {error(s['predicted_as_full_precision_ms'], s['measured_ms']):>9}")
        print(f"{name:<6} {'tok/s':<8} {'':<7} {'':>12} {case['predicted_tok_s']:>17.2f} "
              f"{case['predicted_as_full_precision_tok_s']:>11.2f} {case['measured_tok_s']:>9.2f} "
              f"{error(case['predicted_tok_s'], case['measured_tok_s']):>6} "
              f"{error(case['predicted_as_full_precision_tok_s'], case['measured_tok_s']):>9}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
