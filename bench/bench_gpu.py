"""The GPU path in one short run, for a machine with a CUDA device.

1. Equivalence: for each dtype (bfloat16, float32), layerbus on 2 local stages on the device must
   produce token for token what `transformers` `generate` produces for each prompt alone on the same
   device and dtype. bfloat16 rounds differently in a batched matmul than in a single-row one, so a
   divergence late in a long answer is reported (first differing position), not hidden.
2. Speed: dense story prompts; `generate` with prompts sorted by length at its best batch size
   against layerbus on 1 and 2 stages on the same device, side by side, with tokens/s.

    .venv/bin/python bench/bench_gpu.py                    # cuda:0, about 5.5 minutes on an H200 (both dtypes)
    .venv/bin/python bench/bench_gpu.py --device cpu --prompts 8 --max-new-tokens 8 --check 4   # a dry run

Prints a table and writes bench/results/bench_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from layerbus.models.openmp_waits import prefer_passive_waits  # noqa: E402

prefer_passive_waits()  # before torch loads: this process is the broker (bench/__init__.py)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_pipeline import best_sorted_baseline, run_layerbus  # noqa: E402
from bench.corpus import tokenized_stories  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def reference_tokens(model_dir: Path, prompts, max_new_tokens: int, device: str, dtype: str) -> list[list[int]]:
    """`generate` on each prompt alone (no padding), greedy, on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    outputs = []
    with torch.no_grad():
        for _, ids in prompts:
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
            outputs.append(out[0, len(ids):].tolist())
    del model
    return outputs


def layerbus_tokens(model_dir: Path, prompts, max_new_tokens: int, stages: int, device: str,
                    dtype: str) -> list[list[int]]:
    requests = [GenerationRequest(pid, ids, max_new_tokens=max_new_tokens) for pid, ids in prompts]
    config = BrokerConfig(str(model_dir), stages, batching=BatchingConfig(max_context=4096))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1, device=device, dtype=dtype)) as cluster:
        results, _ = cluster.broker.generate(requests)
    return [result.token_ids for result in results]


def compare(reference: list[list[int]], ours: list[list[int]]) -> dict:
    """How many sequences match, and where the first mismatching ones diverge."""
    diverged = []
    for i, (want, got) in enumerate(zip(reference, ours)):
        if want != got:
            at = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            diverged.append({"prompt": i, "position": at, "reference_len": len(want), "layerbus_len": len(got)})
    return {"sequences": len(reference), "identical": len(reference) - len(diverged), "diverged": diverged[:10]}


def agreement(one_stage: list[list[int]], two_stages: list[list[int]]) -> dict:
    """How many of the speed run's outputs 1 and 2 stages produce identically (same batches, same device)."""
    return {"sequences": len(one_stage), "identical": sum(a == b for a, b in zip(one_stage, two_stages))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the default model)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=256, help="prompts of the speed runs")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--check", type=int, default=16, help="prompts checked token for token")
    parser.add_argument("--batches", type=int, nargs="*", default=[32, 64, 128, 256], help="generate batch sizes tried")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_gpu.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer, read_model_info

    model_dir = args.model or default_model_dir()
    info = read_model_info(model_dir)
    prompts = tokenized_stories(load_tokenizer(model_dir), args.prompts)
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    report = {"model": str(model_dir), "device": args.device, "device_name": device_name,
              "torch": torch.__version__, "equivalence": {}, "stages_agree": {}, "speed": {}}
    for dtype in args.dtypes:
        started = time.perf_counter()
        checked = prompts[:args.check]
        reference = reference_tokens(model_dir, checked, args.max_new_tokens, args.device, dtype)
        report["equivalence"][dtype] = compare(reference, layerbus_tokens(model_dir, checked, args.max_new_tokens, 2,
                                                                           args.device, dtype))
        rows = [best_sorted_baseline(model_dir, prompts, args.max_new_tokens, args.batches, 1, set(info.eos_ids),
                                     device=args.device, dtype=dtype)]
        for stages in (1, 2):
            rows.append(run_layerbus(model_dir, prompts, args.max_new_tokens, stages, 1, device=args.device,
                                     dtype=dtype))
        for row in rows:
            row["vs_generate"] = row["useful_tok_s"] / rows[0]["useful_tok_s"]
        report["stages_agree"][dtype] = agreement(rows[1].pop("outputs"), rows[2].pop("outputs"))
        report["speed"][dtype] = rows
        print(f"{dtype}: done in {time.perf_counter() - started:.0f} s", flush=True)
        # Written after each dtype: a device lease that ends mid-run still leaves the dtypes already measured.
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print_report(report, model_dir, len(prompts), args.max_new_tokens)
    print(f"\nwritten to {args.out}")


def print_report(report: dict, model_dir: Path, prompts: int, max_new_tokens: int) -> None:
    print(f"\n{model_dir.name} on {report['device_name']} ({report['device']}), torch {report['torch']}")
    print("| dtype | 2 stages vs generate alone: identical sequences | first divergence |")
    print("|---|---|---|")
    for dtype, eq in report["equivalence"].items():
        first = eq["diverged"][0] if eq["diverged"] else None
        where = f"prompt {first['prompt']} at token {first['position']}" if first else "-"
        print(f"| {dtype} | {eq['identical']} / {eq['sequences']} | {where} |")
    for dtype, agree in report["stages_agree"].items():
        print(f"{dtype}, the speed run's {agree['sequences']} outputs: 1 and 2 stages identical on {agree['identical']}")
    print(f"\n{prompts} story prompts, {max_new_tokens} new tokens")
    print("| dtype | system | useful tok/s | vs generate |")
    print("|---|---|---|---|")
    for dtype, rows in report["speed"].items():
        for row in rows:
            print(f"| {dtype} | {row['system']} | {row['useful_tok_s']:.1f} | {row['vs_generate']:.2f}x |")


if __name__ == "__main__":
    main()
