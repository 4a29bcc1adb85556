"""Throughput of layerbus against transformers `generate`, on one machine.

Runs, on the same summarization corpus, greedy, float32:
  * transformers `generate` in static batches of --batch prompts (left-padded; the baseline users
    have today): a batch runs until its longest output ends, so finished rows keep computing;
  * layerbus with 1, 2 and 3 local stage processes sharing the machine's cores.
Reports useful new tokens/s (tokens up to and including EOS), model-FLOP utilization against a
measured float32 matmul peak, per-stage busy fractions and the broker's CPU time per token.

    .venv/bin/python bench/bench_pipeline.py            # the full run (about 15 min on 2 cores)
    .venv/bin/python bench/bench_pipeline.py --prompts 32 --stages 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from layerbus.models.openmp_waits import prefer_passive_waits

# This process is the broker (and runs `generate`): its OpenMP threads wait as every `layerbus` command's
# do (models/openmp_waits.py), set before torch loads; bench_dense.py imports this module first and gets it too.
prefer_passive_waits()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import tokenized_prompts  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.planner.partition import model_cost_from_config  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.planner.workload import ASSUMED_OUTPUT_SHARES, Workload  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def matmul_peak_gflops(threads: int, size: int = 1024, seconds: float = 3.0) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    return 2 * size ** 3 * count / (time.perf_counter() - started) / 1e9


def useful_length(tokens: list[int], eos_ids: set[int]) -> int:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return i + 1
    return len(tokens)


def run_baseline(model_dir: Path, prompts, max_new_tokens: int, batch: int, threads: int, eos_ids,
                 sort_by_length: bool = False, device: str = "cpu", dtype: str = "float32") -> dict:
    """`generate` in static batches of `batch` prompts, in corpus order or sorted by prompt length
    (what a user who knows `generate` pads every batch to its longest prompt would do)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    if sort_by_length:
        prompts = sorted(prompts, key=lambda item: len(item[1]))
    useful = computed = 0
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = [ids for _, ids in prompts[i:i + batch]]
        width = max(len(ids) for ids in chunk)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk], device=device)
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
        new = out[:, width:].tolist()
        useful += sum(useful_length(row, eos_ids) for row in new)
        computed += len(new) * len(new[0])
    wall = time.perf_counter() - started
    order = ", prompts sorted by length" if sort_by_length else ""
    return {"system": f"transformers generate (static batches of {batch}{order})", "threads": threads,
            "useful_tokens": useful, "computed_tokens": computed, "wall_s": wall, "useful_tok_s": useful / wall}


def best_sorted_baseline(model_dir: Path, prompts, max_new_tokens: int, batches: list[int], threads: int,
                         eos_ids, device: str = "cpu", dtype: str = "float32") -> dict:
    """`generate` on length-sorted prompts at each batch size; the fastest, with the others' figures."""
    tried = [run_baseline(model_dir, prompts, max_new_tokens, batch, threads, eos_ids, sort_by_length=True,
                          device=device, dtype=dtype) for batch in batches]
    best = max(tried, key=lambda row: row["useful_tok_s"])
    best["tried"] = {row["system"]: round(row["useful_tok_s"], 1) for row in tried}
    best["system"] += " (best of " + ", ".join(str(batch) for batch in batches) + ")"
    return best


def run_layerbus(model_dir: Path, prompts, max_new_tokens: int, stages: int, threads_per_stage: int,
                 batching: BatchingConfig = BatchingConfig(micro_batch_size=0, max_step_tokens=0,
                                                           max_context=4096),
                 device: str = "cpu", dtype: str = "float32", weights: str = "auto") -> dict:
    """layerbus on local stage processes; `batching` as given (its defaults: what `layerbus run` uses)."""
    requests = [GenerationRequest(pid, ids, max_new_tokens=max_new_tokens) for pid, ids in prompts]
    # The job's shape, as `layerbus run` gives it from the store (jobs.job_workload): sizes and plan use it.
    # Nothing like it has run before (no store here): outputs assumed to end evenly up to their budgets.
    workload = Workload.of_prompts([ids for _, ids in prompts], max_new_tokens).with_output_shares(
        ASSUMED_OUTPUT_SHARES, assumed=True)
    config = BrokerConfig(str(model_dir), stages, batching=batching, workload=workload, weights=weights)
    with LocalCluster(config, LocalStageOptions(threads_per_stage=threads_per_stage, device=device,
                                                dtype=dtype)) as cluster:
        results, stats = cluster.broker.generate(requests)
        spans = [str(span) for span in cluster.broker.spans]
        plan, batching = cluster.broker.plan, cluster.broker.batching
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    useful = sum(len(r.token_ids) for r in results)
    busy = {name: s.get("busy_s", 0.0) / stats.wall_s for name, s in sorted(stats.stage_stats.items())}
    system = f"layerbus, {stages} stage(s)" + (f", --weights {weights}" if weights != "auto" else "")
    return {"system": system, "threads": threads_per_stage * stages, "spans": spans, "weights": weights,
            "outputs": [r.token_ids for r in results],
            "useful_tokens": useful, "computed_tokens": useful, "wall_s": stats.wall_s,
            "useful_tok_s": useful / stats.wall_s, "busy_fraction": busy,
            "broker_cpu_ms_per_token": 1000 * stats.broker_cpu_s / max(useful, 1), "steps": stats.steps,
            # what the plan predicted for this job before it ran (None: not planned), and the sizes used
            "predicted_tok_s": plan.chosen.tokens_per_s if plan is not None else None,
            "batching": {"micro_batches": batching.num_micro_batches, "micro_batch_size": batching.micro_batch_size,
                         "slots": batching.num_slots, "max_step_tokens": batching.max_step_tokens}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the default model)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="batch size of the corpus-order baseline")
    parser.add_argument("--sorted-batches", type=int, nargs="*", default=[32, 64, 128],
                        help="batch sizes tried for the length-sorted baseline (its best is the one to beat)")
    parser.add_argument("--stages", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--slots", type=int, default=0, help="layerbus slots (0 = layerbus's own choice)")
    parser.add_argument("--micro-batches", type=int, default=0, help="layerbus micro-batches (0 = its own choice)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--weights", nargs="*", default=["auto"],
                        help="layerbus weight formats, each run on every --stages (e.g. auto native: native's speed against float32's)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_pipeline.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer, read_model_info

    model_dir = args.model or default_model_dir()
    info = read_model_info(model_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts = tokenized_prompts(tokenizer, args.prompts)
    cores = os.cpu_count() or 1
    cost = model_cost_from_config(info.files.config)
    flops_per_token = sum(cost.layer) + cost.head
    peak = matmul_peak_gflops(cores)
    rows = []
    if not args.skip_baseline:
        rows.append(run_baseline(model_dir, prompts, args.max_new_tokens, args.batch, cores, set(info.eos_ids)))
        rows.append(best_sorted_baseline(model_dir, prompts, args.max_new_tokens, args.sorted_batches, cores,
                                         set(info.eos_ids)))
    # 0 = chosen by the broker from the stages' profiles, as `layerbus run` does by default
    batching = BatchingConfig(num_slots=args.slots, num_micro_batches=args.micro_batches, micro_batch_size=0,
                              max_step_tokens=0, max_context=4096)
    for stages in args.stages:
        first = None  # this stage count's run in the first of --weights: the others are compared with it
        for weights in args.weights:
            row = run_layerbus(model_dir, prompts, args.max_new_tokens, stages, max(1, cores // stages), batching,
                               weights=weights)
            rows.append(row)
            if first is None:
                first = row
                continue
            row["vs_first_weights"] = row["useful_tok_s"] / first["useful_tok_s"]
            row["same_tokens_as_first_weights"] = row["outputs"] == first["outputs"]
            print(f"{row['system']}: {row['vs_first_weights']:.2f}x the tokens/s of {first['system']}; "
                  f"same tokens: {row['same_tokens_as_first_weights']}", flush=True)
    for row in rows:
        row.pop("outputs", None)
    for row in rows:
        row["mfu"] = flops_per_token * row["useful_tok_s"] / (peak * 1e9)
    report = {"model": str(model_dir), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "prompt_tokens": sum(len(ids) for _, ids in prompts), "cores": cores,
              "matmul_peak_gflops": peak, "flops_per_token": flops_per_token, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{len(prompts)} prompts ({report['prompt_tokens']} prompt tokens), max_new_tokens {args.max_new_tokens}, "
          f"{cores} cores, float32 matmul peak {peak:.0f} GFLOP/s, {flops_per_token / 1e6:.0f} MFLOP/token")
    print("| system | threads | useful tok/s | predicted (error) | MFU | wall s | useful / computed tokens | stage busy | "
          "broker CPU ms/token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        busy = ", ".join(f"{v:.0%}" for v in row.get("busy_fraction", {}).values()) or "-"
        broker = f"{row['broker_cpu_ms_per_token']:.2f}" if "broker_cpu_ms_per_token" in row else "-"
        predicted = row.get("predicted_tok_s")
        versus = (f"{predicted:.1f} ({row['useful_tok_s'] / predicted - 1:+.0%})" if predicted else "-")
        print(f"| {row['system']} | {row['threads']} | {row['useful_tok_s']:.1f} | {versus} | {row['mfu']:.1%} | "
              f"{row['wall_s']:.1f} | "
              f"{row['useful_tokens']} / {row['computed_tokens']} | {busy} | {broker} |")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
