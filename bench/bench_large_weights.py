"""Weight formats on a model where they matter: the 1.28B-parameter Llama of the tests (random
weights, built here as bfloat16 shards by tests/helpers/large_model.py, 2.6 GB) on 2 local stages of one thread
each, held in fp32, bf16, int8 and int4 one after the other in one run: tokens/s of the same requests,
each stage's weight bytes and peak resident memory since its load (VmHWM), and whether the formats
generated the same tokens as fp32 (random weights make a flat distribution, so quantized formats may
well differ: the quality figures are `layerbus quality`'s on the default model).

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_large_weights.py     # about 5 minutes

Prints a table and writes bench/results/bench_large_weights.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerbus.models.openmp_waits import prefer_passive_waits  # noqa: E402

prefer_passive_waits()  # before torch loads: this process is the broker (bench/__init__.py)

from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.broker.profiling import ProfilingConfig  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.models.model_info import load_tokenizer  # noqa: E402
from tests.helpers.large_model import make_large_model  # noqa: E402
from tests.helpers.memory import vm_hwm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_large_weights.json"
FORMATS = ("fp32", "bf16", "int8", "int4")
MIB = 1 << 20


def run_format(model_dir: Path, weights: str, prompts: list[list[int]], new_tokens: int) -> dict:
    requests = [GenerationRequest(f"p{i}", ids, max_new_tokens=new_tokens) for i, ids in enumerate(prompts)]
    config = BrokerConfig(str(model_dir), 2, weights=weights, partition="equal", profiling=ProfilingConfig(probe_s=0),
                          batching=BatchingConfig(num_slots=len(requests), max_step_tokens=64, max_context=128))
    # Fresh stage processes (not forks of a launcher): each stage's peak is its own.
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1, fork=False)) as cluster:
        began = time.perf_counter()
        results, _ = cluster.broker.generate(requests)
        seconds = time.perf_counter() - began
        stages = [{"name": s.name, "weights": s.weights, "weight_bytes": s.param_bytes, "peak_rss": vm_hwm(s.pid)}
                  for s in cluster.broker.chain]
    tokens = sum(len(r.token_ids) for r in results)
    return {"weights": weights, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
            "weight_bytes": sum(s["weight_bytes"] for s in stages), "stages": stages,
            "outputs": [r.token_ids for r in results], "errors": [r.error for r in results if r.error]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="layerbus-large-") as folder:
        model_dir = make_large_model(Path(folder) / "llama-1.28b")
        tokenizer = load_tokenizer(model_dir)
        texts = ["The stage receives a batch of rows", "Count from one to ten:", "A broker keeps the queue",
                 "Old cards on ordinary Ethernet"]
        prompts = [tokenizer(texts[i % len(texts)]).input_ids for i in range(args.prompts)]
        runs = []
        for weights in args.formats:
            runs.append(run_format(model_dir, weights, prompts, args.new_tokens))
            run = runs[-1]
            peaks = ", ".join(f"{stage['peak_rss'] / MIB:,.0f}" for stage in run["stages"])
            print(f"{weights:<5} {run['tokens']} tokens in {run['seconds']:.1f} s: {run['tokens_per_s']:.2f} tok/s; "
                  f"weights {run['weight_bytes'] / MIB:,.0f} MiB; stage peaks {peaks} MiB", flush=True)
    base = runs[0]
    print()
    print("| weights | tok/s | vs fp32 | weight bytes (both stages) | stage peak RSS | same tokens as fp32 |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        run["vs_first"] = round(run["tokens_per_s"] / base["tokens_per_s"], 2)
        run["same_tokens_as_first"] = run["outputs"] == base["outputs"]
        peaks = ", ".join(f"{s['peak_rss'] / MIB:,.0f} MiB" for s in run["stages"])
        print(f"| {run['weights']} | {run['tokens_per_s']:.2f} | {run['vs_first']:.2f}x | "
              f"{run['weight_bytes']:,} | {peaks} | {'yes' if run['same_tokens_as_first'] else 'no'} |")
    for run in runs:
        del run["outputs"]
    RESULTS.write_text(json.dumps({"prompts": args.prompts, "new_tokens": args.new_tokens, "first": base["weights"],
                                   "runs": runs}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
