"""Dense work: layerbus against `generate` where `generate` wastes nothing.

Similar-length prompts (long-story requests, about 55 tokens with the chat template) whose answers
mostly run to the token limit: no padding and almost no finished rows for `generate` to carry, so
its only handicap is gone. `generate` gets prompts sorted by length and its best batch size of
--batches; layerbus runs with its own defaults (`layerbus run` without batching options) on 1 and
2 local stage processes sharing the machine's cores. Greedy, float32, side by side: each round
runs every system once, in turn, and the table shows medians over the rounds.

    .venv/bin/python bench/bench_dense.py                 # 128 prompts, 64 new tokens (about 10 min on 2 cores)
    .venv/bin/python bench/bench_dense.py --prompts 64 --batches 32 64 --rounds 3   # as bench/README.md tables it
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_pipeline import best_sorted_baseline, run_layerbus  # noqa: E402
from bench.corpus import tokenized_stories  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the default model)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="*", default=[32, 64, 128], help="generate batch sizes tried")
    parser.add_argument("--stages", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=1, help="run every system this many times, in turn; "
                        "report medians")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_dense.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer, read_model_info

    model_dir = args.model or default_model_dir()
    info = read_model_info(model_dir)
    prompts = tokenized_stories(load_tokenizer(model_dir), args.prompts)
    cores = os.cpu_count() or 1
    # The machine is shared: single runs of one system moved by 1.4x between runs. Each round runs
    # every system once, in turn, and the table shows each system's median over the rounds.
    rounds = []
    for _ in range(args.rounds):
        round_rows = [best_sorted_baseline(model_dir, prompts, args.max_new_tokens, args.batches, cores,
                                           set(info.eos_ids))]
        for stages in args.stages:
            round_rows.append(run_layerbus(model_dir, prompts, args.max_new_tokens, stages, max(1, cores // stages)))
        rounds.append(round_rows)
    # Greedy: every layerbus run (each stage count, each round) must give the same tokens.
    layerbus_outputs = [run["outputs"] for round_rows in rounds for run in round_rows[1:]]
    outputs_identical = all(outputs == layerbus_outputs[0] for outputs in layerbus_outputs)
    rows = [_median_row([r[i] for r in rounds]) for i in range(len(rounds[0]))]
    for row in rows:
        row.pop("outputs", None)
    baseline = rows[0]
    one_stage = next((row for row in rows[1:] if row["system"] == "layerbus, 1 stage(s)"), None)
    for row in rows:
        row["vs_generate"] = row["useful_tok_s"] / baseline["useful_tok_s"]
        if one_stage is not None and row is not baseline:
            row["vs_one_stage"] = row["useful_tok_s"] / one_stage["useful_tok_s"]
    report = {"model": str(model_dir), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "prompt_tokens": sum(len(ids) for _, ids in prompts), "cores": cores, "rounds": args.rounds, "rows": rows,
              "layerbus_outputs_identical": outputs_identical,
              "targets": {"1 stage vs generate": ">= 1.0x (aim 1.3x)", "2 stages vs 1 stage": ">= 0.95x"}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{len(prompts)} story prompts ({report['prompt_tokens']} prompt tokens), max_new_tokens "
          f"{args.max_new_tokens}, {cores} cores; generate tried: {baseline['tried']}")
    print("| system | useful tok/s (median) | each round | vs generate | vs 1 stage | useful / computed tokens | stage busy |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        busy = ", ".join(f"{v:.0%}" for v in row.get("busy_fraction", {}).values()) or "-"
        versus = f"{row['vs_one_stage']:.2f}x" if "vs_one_stage" in row else "-"
        each = ", ".join(f"{v:.1f}" for v in row["rounds_tok_s"])
        print(f"| {row['system']} | {row['useful_tok_s']:.1f} | {each} | {row['vs_generate']:.2f}x | {versus} | "
              f"{row['useful_tokens']} / {row['computed_tokens']} | {busy} |")
    print(f"\nlayerbus outputs identical over every stage count and round: {'yes' if outputs_identical else 'NO'}")
    print(f"written to {args.out}")


def _median_row(runs: list[dict]) -> dict:
    """One system's row over the rounds: its median tokens/s (for `generate`: the best batch size by
    median), each round's figure kept in `rounds_tok_s`."""
    row = dict(runs[len(runs) // 2])
    if "tried" in row:  # generate: the median of each batch size, then the best of those
        tried = {name: statistics.median(run["tried"][name] for run in runs) for name in row["tried"]}
        best = max(tried, key=tried.get)
        row.update(tried=tried, useful_tok_s=tried[best],
                   system=best + row["system"][row["system"].index(" (best of"):])
        row["rounds_tok_s"] = [run["tried"][best] for run in runs]
    else:
        row["useful_tok_s"] = statistics.median(run["useful_tok_s"] for run in runs)
        row["rounds_tok_s"] = [round(run["useful_tok_s"], 1) for run in runs]
    return row


if __name__ == "__main__":
    main()
