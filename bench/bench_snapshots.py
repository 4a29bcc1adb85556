"""What the stage snapshots (`layerbus top`) cost a run: tokens/s with them on and off, side by side.

One local cluster (tiny random-weight llama, so the broker's own work is as large a share as it gets)
runs the same job shape again and again, snapshots on and off in turn (on, off, off, on, ...), so a
drift of the machine's load falls on both alike; then the median of each, and the median time of one
snapshot write (JobStore.record_stage_snapshots) on that store.

    .venv/bin/python bench/bench_snapshots.py [--pairs 3] [--items 400] [--max-new-tokens 64] [--stages 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_pipeline import RESULTS_DIR  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="runs with snapshots on, and as many off")
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between snapshots when on")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_snapshots.json")
    args = parser.parse_args()

    from layerbus.broker.broker import BrokerConfig
    from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
    from layerbus.jobs.runner import run_job
    from layerbus.jobs.snapshot_keeper import SnapshotConfig
    from layerbus.storage import JobSettings, JobStore, NewItem
    from tests.helpers.tiny_models import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="layerbus-bench-snapshots-"))
    os.environ["LAYERBUS_HOME"] = str(work / "home")
    model_dir = make_tiny_model("llama", work / "model")
    db_url = f"sqlite:///{work / 'jobs.db'}"
    words = "the stage receives a batch of hidden states runs its layers and sends the result on".split()
    items = [NewItem(f"item-{i}", "", " ".join(words[(i + k) % len(words)] for k in range(4 + i % 9)), {}, i)
             for i in range(args.items)]
    settings = JobSettings(task="generate", model=str(model_dir), max_new_tokens=args.max_new_tokens)
    order = [on for pair in range(args.pairs) for on in ((True, False) if pair % 2 == 0 else (False, True))]
    runs: list[dict] = []
    config = BrokerConfig(str(model_dir), args.stages)
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster, JobStore.open(db_url) as store:
        run_job(store, store.create_job(settings, items[:8]), cluster.broker, work / "results")  # warm-up
        for on in order:
            job_id = store.create_job(settings, items)
            snapshots = SnapshotConfig(interval_s=args.interval, enabled=on)
            started = time.perf_counter()
            status = run_job(store, job_id, cluster.broker, work / "results", snapshots=snapshots)
            wall_s = time.perf_counter() - started
            assert status.status == "completed", status
            runs.append({"snapshots": on, "wall_s": wall_s, "tokens": status.completion_tokens,
                         "tokens_per_s": status.completion_tokens / wall_s,
                         "rows": len(store.stage_snapshots(job_id))})
            print(f"snapshots {'on ' if on else 'off'}: {runs[-1]['tokens_per_s']:.1f} tok/s "
                  f"({status.completion_tokens} tokens in {wall_s:.1f} s)", flush=True)
        write_times = []
        for _ in range(20):
            take = cluster.broker.stage_snapshots()
            started = time.perf_counter()
            store.record_stage_snapshots(job_id, "bench", take)
            write_times.append(time.perf_counter() - started)

    on = [r["tokens_per_s"] for r in runs if r["snapshots"]]
    off = [r["tokens_per_s"] for r in runs if not r["snapshots"]]
    report = {"stages": args.stages, "items": args.items, "max_new_tokens": args.max_new_tokens,
              "interval_s": args.interval, "runs": runs, "on_median_tokens_per_s": statistics.median(on),
              "off_median_tokens_per_s": statistics.median(off),
              "write_ms_median": 1000 * statistics.median(write_times)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{args.stages} stages, tiny llama, {args.items} items x {args.max_new_tokens} new tokens, "
          f"{args.pairs} runs each, interleaved")
    print("| snapshots | tok/s per run | median |\n|---|---|---|")
    print(f"| on (every {args.interval:g} s) | {', '.join(f'{x:.1f}' for x in on)} | {report['on_median_tokens_per_s']:.1f} |")
    print(f"| off | {', '.join(f'{x:.1f}' for x in off)} | {report['off_median_tokens_per_s']:.1f} |")
    print(f"\none snapshot write ({args.stages} stages, SQLite): median {report['write_ms_median']:.2f} ms of 20")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
