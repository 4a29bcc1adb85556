"""Speculative decoding on against off, side by side in one run, on the default model and local stages:

  * few rows: summarization prompts of the pipeline corpus (bench/corpus.py) with --slots sequences in flight on
    --stages stages, greedy, then sampled (temperature 0.8, seeded): `auto` against `off`;
  * dense: --dense-prompts story prompts with full micro-batches (the broker's own sizes), greedy: `auto` against
    `off` (it should not be slower beyond noise).

Each case prints tokens/s off and on, the ratio, the acceptance rate, tokens per trip, the planner's last predicted
gain against the measured one, and whether the outputs are identical; JSON goes to bench/results/.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_speculation.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import tokenized_prompts, tokenized_stories  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.planner.speculation import SpeculationConfig  # noqa: E402
from layerbus.planner.workload import Workload  # noqa: E402
from layerbus.wire.sampling import SamplingParams  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run(model_dir: Path, prompts, max_new_tokens: int, stages: int, slots: int, mode: str, sampled: bool) -> dict:
    sampling = (lambda i: SamplingParams(temperature=0.8, seed=i)) if sampled else (lambda i: SamplingParams())
    requests = [GenerationRequest(pid, ids, max_new_tokens=max_new_tokens, sampling=sampling(i))
                for i, (pid, ids) in enumerate(prompts)]
    batching = BatchingConfig(num_slots=slots, micro_batch_size=0, max_step_tokens=0, max_context=4096,
                              speculation=SpeculationConfig(mode=mode))
    config = BrokerConfig(str(model_dir), stages, batching=batching,
                          workload=Workload.of_prompts([ids for _, ids in prompts], max_new_tokens))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=max(1, 2 // stages))) as cluster:
        started = time.perf_counter()
        results, stats = cluster.broker.generate(requests)
        wall = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    return {"mode": mode, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "speculation": stats.speculation, "outputs": [r.token_ids for r in results]}


def case(name: str, model_dir: Path, prompts, max_new_tokens: int, stages: int, slots: int, sampled: bool) -> dict:
    off = run(model_dir, prompts, max_new_tokens, stages, slots, "off", sampled)
    on = run(model_dir, prompts, max_new_tokens, stages, slots, "auto", sampled)
    figures = on["speculation"] or {}
    result = {"case": name, "items": len(prompts), "stages": stages, "slots": slots or "chosen", "sampled": sampled,
              "max_new_tokens": max_new_tokens, "tok_s_off": off["tok_s"], "tok_s_on": on["tok_s"],
              "speedup": on["tok_s"] / off["tok_s"], "identical_outputs": on["outputs"] == off["outputs"],
              "acceptance": figures.get("acceptance", 0.0), "tokens_per_trip": figures.get("tokens_per_trip", 1.0),
              "predicted_speedup": figures.get("predicted_speedup", 1.0), "speculation": figures,
              "wall_s_off": off["wall_s"], "wall_s_on": on["wall_s"]}
    print(f"{name:<28} off {off['tok_s']:7.1f} tok/s  auto {on['tok_s']:7.1f} ({result['speedup']:.2f}x; predicted "
          f"{result['predicted_speedup']:.2f}x)  acceptance {100 * result['acceptance']:.0f}%  tokens/trip "
          f"{result['tokens_per_trip']:.2f}  identical {result['identical_outputs']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--dense-prompts", type=int, default=32)
    parser.add_argument("--dense-new-tokens", type=int, default=48)
    parser.add_argument("--skip-sampled", action="store_true")
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_speculation.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer

    model_dir = default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    prompts = tokenized_prompts(tokenizer, args.prompts)
    report = {"model": str(model_dir), "cases": []}
    report["cases"].append(case("few rows, greedy", model_dir, prompts, args.max_new_tokens, args.stages,
                                args.slots, False))
    if not args.skip_sampled:
        report["cases"].append(case("few rows, sampled", model_dir, prompts, args.max_new_tokens, args.stages,
                                    args.slots, True))
    if not args.skip_dense:
        report["cases"].append(case("dense, greedy", model_dir, tokenized_stories(tokenizer, args.dense_prompts),
                                    args.dense_new_tokens, args.stages, 0, False))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
