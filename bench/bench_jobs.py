"""Batch-job overhead: 10,000 tiny items through submit -> run -> results.

A tiny random-weight model keeps the model's own time small, so what is measured is layerbus:
  * `layerbus submit` wall time for the whole file (parse, validate, render, one transaction);
  * the broker's own CPU time per item during `run` (claims, tokenizing, scheduling, decoding,
    part files, store commits, the final Parquet), measured as this process's CPU time, since the
    broker runs here and the stages are separate processes;
  * the store's size on disk, and `layerbus status JOB` wall time on that store (goal < 100 ms).

    .venv/bin/python bench/bench_jobs.py [--items 10000] [--stages 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_pipeline import RESULTS_DIR  # noqa: E402


def layerbus(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / "layerbus"), *args], env=env, capture_output=True,
                          text=True, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_jobs.json")
    args = parser.parse_args()

    from layerbus.broker.broker import BrokerConfig
    from layerbus.jobs.runner import run_job
    from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
    from layerbus.storage import JobStore
    from layerbus.storage.results import read_results
    from tests.helpers.tiny_models import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="layerbus-bench-jobs-"))
    env = dict(os.environ, LAYERBUS_HOME=str(work / "home"))
    os.environ["LAYERBUS_HOME"] = env["LAYERBUS_HOME"]
    model_dir = make_tiny_model("llama", work / "model")
    db_path = work / "jobs.db"
    db_url = f"sqlite:///{db_path}"
    words = "the stage receives a batch of hidden states runs its layers and sends the result on".split()
    corpus = work / "items.jsonl"
    with corpus.open("w") as handle:
        for i in range(args.items):
            text = " ".join(words[(i + k) % len(words)] for k in range(3 + i % 9))
            handle.write(json.dumps({"id": f"item-{i:05d}", "prompt": text}) + "\n")

    started = time.perf_counter()
    job_id = layerbus("submit", str(corpus), "--task", "generate", "--model", str(model_dir), "--db", db_url,
                      "--max-new-tokens", str(args.max_new_tokens), env=env).stdout.strip()
    submit_s = time.perf_counter() - started

    config = BrokerConfig(str(model_dir), args.stages)
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster, JobStore.open(db_url) as store:
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        status = run_job(store, job_id, cluster.broker, work / "home" / "results")
        run_cpu_s, run_wall_s = time.process_time() - cpu_started, time.perf_counter() - wall_started
    table = read_results(Path(status.results_path))
    assert table.num_rows == args.items and len(set(table.column("custom_id").to_pylist())) == args.items

    status_times = []
    for _ in range(7):
        started = time.perf_counter()
        layerbus("status", job_id, "--db", db_url, env=env)
        status_times.append(time.perf_counter() - started)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sqlalchemy"], check=True)
    sqlalchemy_import_s = time.perf_counter() - started
    with JobStore.open(db_url) as store:
        query_times = []
        for _ in range(20):
            started = time.perf_counter()
            store.job_status(job_id)
            query_times.append(time.perf_counter() - started)

    report = {
        "items": args.items, "stages": args.stages, "max_new_tokens": args.max_new_tokens, "job_status": status.status,
        "submit_s": submit_s, "run_wall_s": run_wall_s, "broker_cpu_s": run_cpu_s,
        "broker_cpu_ms_per_item": 1000 * run_cpu_s / args.items, "items_per_s": args.items / run_wall_s,
        "store_bytes": db_path.stat().st_size + sum(p.stat().st_size for p in work.glob("jobs.db-*")),
        "status_cli_ms_median": 1000 * statistics.median(status_times),
        "status_query_ms_median": 1000 * statistics.median(query_times),
        "python_import_sqlalchemy_ms": 1000 * sqlalchemy_import_s,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{args.items} items, tiny llama model, {args.stages} stages, max_new_tokens {args.max_new_tokens}")
    print("| measure | value |\n|---|---|")
    print(f"| submit (parse, validate, render, store) | {submit_s:.1f} s |")
    print(f"| run wall time | {run_wall_s:.1f} s ({report['items_per_s']:.0f} items/s) |")
    print(f"| broker's own CPU per item | {report['broker_cpu_ms_per_item']:.2f} ms |")
    print(f"| store size (SQLite, WAL included) | {report['store_bytes'] / 2**20:.1f} MiB |")
    print(f"| `layerbus status JOB` (median of 7, whole command) | {report['status_cli_ms_median']:.0f} ms |")
    print(f"| of which the status query (median of 20) | {report['status_query_ms_median']:.1f} ms |")
    print(f"| `python -c 'import sqlalchemy'` alone | {report['python_import_sqlalchemy_ms']:.0f} ms |")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
