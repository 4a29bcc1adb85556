"""Recovery from a killed stage, on the default model.

Runs the same greedy summarization corpus three times on SmolLM2-135M-Instruct, float32, one thread per stage:
  * a fresh run on 2 local stages (the reference throughput);
  * a run on 3 local stages where one stage is killed with SIGKILL once a fraction of the requests
    has finished. The broker detects the loss (liveness window), re-plans over the 2 survivors,
    they load their new spans keeping the caches of the layers they hold again, and the broker
    replays only the layers nobody kept (broker/replay_window.py);
  * the same faulted run with the caches not kept (BatchingConfig(keep_caches=False), --no-keep-caches): every active
    sequence re-prefills what it knows over every layer, as before the caches were kept.
Reports the time from the kill to the first new token (split into detection, re-plan + reload, and
re-prefill up to that token), throughput after the recovery against the fresh 2-stage run, and
whether the outputs equal the unfaulted run's.

Throughput is measured from the first new token (after the recovery, for the faulted run) to the
moment the last request was admitted: both runs are then full of work, and the tail where the
batch drains is left out of both. The faulted run's window includes re-prefilling every active
sequence; the table also shows the throughput once that re-prefill is over.

    .venv/bin/python bench/bench_faults.py                 # about 9 minutes on 2 cores
    .venv/bin/python bench/bench_faults.py --prompts 80    # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import tokenized_prompts  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.broker.pipeline import PipelineConfig  # noqa: E402
from layerbus.broker.run_state import ListSource  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def window_throughput(progress: list[tuple[float, int]], start: float, end: float) -> float:
    """New tokens per second emitted in [start, end]."""
    inside = [(t, n) for t, n in progress if start <= t <= end]
    if len(inside) < 2:
        return float("nan")
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return (n1 - n0) / (t1 - t0)


def run(model_dir: Path, requests, num_stages: int, kill_after: int | None, liveness_s: float, slots: int,
        keep_caches: bool = True) -> dict:
    config = BrokerConfig(str(model_dir), num_stages, pipeline=PipelineConfig(liveness_window_s=liveness_s),
                          batching=BatchingConfig(num_slots=slots, keep_caches=keep_caches))
    marks: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}

    with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
        class Sink:
            def deliver(self, results):
                outputs.update((r.request_id, r.token_ids) for r in results)
                if kill_after is not None and len(outputs) >= kill_after and "kill" not in marks:
                    # The middle stage of the chain (LocalCluster names process i stage-i; the planner orders them).
                    middle = cluster.broker.placement.stages[1]
                    victim = cluster.processes[int(middle.rsplit("-", 1)[1])]
                    marks["kill"] = time.monotonic()
                    os.kill(victim.pid, signal.SIGKILL)

        def events(kind, message, **fields):
            marks.setdefault(kind, time.monotonic())

        started = time.monotonic()
        stats = cluster.broker.run(ListSource(requests), Sink(), events=events)
        spans = cluster.broker.placement.text()
    result = {"stages": num_stages, "wall_s": round(time.monotonic() - started, 2), "new_tokens": stats.new_tokens,
              "final_chain": spans, "outputs": outputs}
    end = stats.source_exhausted_at or stats.progress[-1][0]
    if kill_after is None:
        result["throughput_tok_s"] = round(window_throughput(stats.progress, stats.progress[0][0], end), 2)
        return result
    recovery = stats.recoveries[0]
    result.update({
        "killed": recovery.get("stage"),
        "detect_s": round(marks["stage_lost"] - marks["kill"], 2),
        "replan_reload_s": round(marks["recovered"] - marks["stage_lost"], 2),
        "to_first_token_s": round(marks["first_token"] - marks["kill"], 2),
        "reprefill_tokens": recovery["reprefill_tokens"],
        "replay_layers": recovery.get("replay_layers"),
        "lost_span": recovery.get("lost_span"),
        "throughput_after_tok_s": round(window_throughput(stats.progress, marks["first_token"], end), 2),
        "window_after_s": round(end - marks["first_token"], 1),
        "reprefill_done_s": round(marks.get("reprefilled", float("nan")) - marks["kill"], 2),
        "throughput_after_reprefill_tok_s": round(window_throughput(stats.progress, marks.get("reprefilled", end), end), 2),
    })
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=48,
                        help="sequences in flight, the same for both runs; well under --prompts so that both "
                             "runs stay full of work for a while after the kill")
    parser.add_argument("--kill-fraction", type=float, default=0.25, help="kill once this fraction has finished")
    parser.add_argument("--liveness-window", type=float, default=PipelineConfig().liveness_window_s)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from layerbus.models.default_model import default_model_dir

    model_dir = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = [GenerationRequest(name, ids, max_new_tokens=args.max_new_tokens)
                for name, ids in tokenized_prompts(tokenizer, args.prompts)]
    fresh = run(model_dir, requests, 2, None, args.liveness_window, args.slots)
    kill_after = max(1, int(args.prompts * args.kill_fraction))
    faulted = run(model_dir, requests, 3, kill_after, args.liveness_window, args.slots)
    every_layer = run(model_dir, requests, 3, kill_after, args.liveness_window, args.slots, keep_caches=False)
    same = sum(fresh["outputs"][r.request_id] == faulted["outputs"][r.request_id] for r in requests)
    same_every = sum(fresh["outputs"][r.request_id] == every_layer["outputs"][r.request_id] for r in requests)
    ratio = faulted["throughput_after_tok_s"] / fresh["throughput_tok_s"]
    ratio_every = every_layer["throughput_after_tok_s"] / fresh["throughput_tok_s"]
    layers = faulted["replay_layers"]

    rows = [
        ("kill -> first new token (goal <= 10 s)", f"{faulted['to_first_token_s']:.2f} s",
         "met" if faulted["to_first_token_s"] <= 10 else "MISSED"),
        ("  detection (liveness window)", f"{faulted['detect_s']:.2f} s", f"window {args.liveness_window:g} s"),
        ("  re-plan + reload", f"{faulted['replan_reload_s']:.2f} s", faulted["final_chain"] if isinstance(faulted["final_chain"], str) else ", ".join(faulted["final_chain"])),
        ("  replay to the first token", f"{faulted['to_first_token_s'] - faulted['detect_s'] - faulted['replan_reload_s']:.2f} s",
         f"{faulted['reprefill_tokens']} cached positions replayed over layers {layers} (lost: {faulted['lost_span']})"),
        ("throughput after recovery (goal >= 0.90x fresh 2-stage)", f"{faulted['throughput_after_tok_s']:.1f} tok/s",
         f"{ratio:.2f}x of {fresh['throughput_tok_s']:.1f} tok/s: " + ("met" if ratio >= 0.9 else "MISSED")),
        ("  ... of which after the re-prefill", f"{faulted['throughput_after_reprefill_tok_s']:.1f} tok/s",
         f"{faulted['throughput_after_reprefill_tok_s'] / fresh['throughput_tok_s']:.2f}x; the re-prefill ended "
         f"{faulted['reprefill_done_s']:.1f} s after the kill"),
        ("outputs equal to the unfaulted 2-stage run", f"{same}/{len(requests)}", ""),
        ("caches not kept: kill -> first new token", f"{every_layer['to_first_token_s']:.2f} s",
         f"every layer re-prefilled: {every_layer['reprefill_tokens']} tokens"),
        ("caches not kept: throughput after recovery", f"{every_layer['throughput_after_tok_s']:.1f} tok/s",
         f"{ratio_every:.2f}x; the re-prefill ended {every_layer['reprefill_done_s']:.1f} s after the kill; "
         f"outputs equal {same_every}/{len(requests)}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\nSmolLM2 recovery: {args.prompts} prompts, {args.max_new_tokens} new tokens, {args.slots} slots, "
          "1 thread per stage")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")
    RESULTS_DIR.mkdir(exist_ok=True)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "fresh_2_stages": {k: v for k, v in fresh.items() if k != "outputs"},
              "killed_1_of_3": {k: v for k, v in faulted.items() if k != "outputs"},
              "killed_1_of_3_caches_not_kept": {k: v for k, v in every_layer.items() if k != "outputs"},
              "throughput_ratio": round(ratio, 3), "throughput_ratio_caches_not_kept": round(ratio_every, 3),
              "same_outputs": same, "same_outputs_caches_not_kept": same_every, "requests": len(requests)}
    (RESULTS_DIR / "bench_faults.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {RESULTS_DIR / 'bench_faults.json'}")


if __name__ == "__main__":
    main()
