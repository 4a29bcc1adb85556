"""Quantized weights: the block kernel against the float32 matmul, and the default model end to end.

  1. One Linear per SmolLM2-135M shape, 1 / 8 / 32 / 64 / 128 rows, 1 thread: the float32 matmul, the
     Q4_1 PackedLinear with the compiled kernel (one-pass dequantization of a tile, then torch's float32
     matmul on it) and with torch ops only (the naive path). Milliseconds, median of repeats, and the
     ratio of each to float32 (above 1 = slower).
  2. The default model on 3 local stages, the sample corpus's first documents as summarize prompts:
     tokens/s with --weights auto (float32) and native (the GGUF's own Q4_1 blocks), side by side in one
     run, and whether both generated the very same tokens.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_weights.py      # about 2-3 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerbus.models.openmp_waits import prefer_passive_waits  # noqa: E402

prefer_passive_waits()  # before torch loads: this process is the broker (bench/__init__.py)

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.jobs.corpus import corpus_prompts  # noqa: E402
from layerbus.models.default_model import default_model_dir  # noqa: E402
from layerbus.models.model_info import load_tokenizer  # noqa: E402
from layerbus.models.weight_blocks import quantize  # noqa: E402
from layerbus.stages import block_kernel  # noqa: E402
from layerbus.stages.packed_linear import PackedLinear  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_weights.json"
# (name, in_features, out_features) of SmolLM2-135M's projections and its tied head.
SHAPES = [("q/o 576x576", 576, 576), ("k/v 576x192", 576, 192), ("gate/up 576x1536", 576, 1536),
          ("down 1536x576", 1536, 576), ("head 576x49152", 576, 49152)]
ROWS = [1, 8, 32, 64, 128]


def median_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def kernel_table(repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    rows_out = []
    for name, cols, out in SHAPES:
        weight = torch.randn(out, cols) * 0.05
        packed = PackedLinear(cols, out, "q4_1", None)
        packed.load_blocks(quantize(weight, "q4_1"))
        for rows in ROWS:
            x = torch.randn(rows, cols)
            reps = max(3, repeats // (10 if out > 10000 else 1))
            fp32 = median_ms(lambda: F.linear(x, weight), reps)
            fused = median_ms(lambda: packed(x), reps)
            saved, block_kernel._kernel = block_kernel._kernel, None  # the torch-ops path
            naive = median_ms(lambda: packed(x), reps)
            block_kernel._kernel = saved
            rows_out.append({"shape": name, "rows": rows, "fp32_ms": round(fp32, 4), "kernel_ms": round(fused, 4),
                             "naive_ms": round(naive, 4), "kernel_vs_fp32": round(fused / fp32, 2),
                             "naive_vs_fp32": round(naive / fp32, 2)})
            print(f"{name:<18} {rows:>4} rows   fp32 {fp32:8.3f} ms   kernel {fused:8.3f} ms ({fused / fp32:4.2f}x)"
                  f"   torch ops {naive:8.3f} ms ({naive / fp32:4.2f}x)", flush=True)
    return rows_out


def end_to_end(documents: int, new_tokens: int) -> dict:
    model_dir = default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    prompts = corpus_prompts(tokenizer)[:documents]
    out = {}
    for weights in ("auto", "native"):
        requests = [GenerationRequest(f"d{i}", ids, max_new_tokens=new_tokens) for i, ids in enumerate(prompts)]
        config = BrokerConfig(str(model_dir), 3, weights=weights, partition="balanced",
                              batching=BatchingConfig(num_slots=len(requests), max_step_tokens=256))
        with LocalCluster(config, LocalStageOptions()) as cluster:
            held = sum(stage.param_bytes for stage in cluster.broker.chain)
            began = time.perf_counter()
            results, _ = cluster.broker.generate(requests)
            seconds = time.perf_counter() - began
        tokens = sum(len(r.token_ids) for r in results)
        out[weights] = {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                        "weight_bytes": held, "outputs": [r.token_ids for r in results]}
        print(f"{weights:<7} {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tok/s; stages hold "
              f"{held:,} weight bytes", flush=True)
    same = out["auto"]["outputs"] == out["native"]["outputs"]
    ratio = out["native"]["tokens_per_s"] / out["auto"]["tokens_per_s"]
    print(f"native / fp32: {ratio:.2f}x tokens/s, {out['native']['weight_bytes'] / out['auto']['weight_bytes']:.3f}x "
          f"weight bytes; same tokens: {same}")
    for entry in out.values():
        del entry["outputs"]
    return {"documents": documents, "new_tokens": new_tokens, "runs": out, "same_tokens": same,
            "native_vs_fp32_tokens_per_s": round(ratio, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--skip-end-to-end", action="store_true")
    args = parser.parse_args()
    report = {"kernel": kernel_table(args.repeats)}
    if not args.skip_end_to_end:
        report["end_to_end"] = end_to_end(args.documents, args.new_tokens)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
