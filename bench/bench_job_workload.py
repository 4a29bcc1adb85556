"""What `layerbus run` spends on a queued job's workload before it plans (jobs/job_workload.py):
time and peak RSS of job_workload on a job of many short documents, and the plan's totals from it.

    LAYERBUS_MODEL_CACHE=... .venv/bin/python bench/bench_job_workload.py --items 200000 --folder /tmp/wl

The job is made once (bench_store_scale's 60-word documents, `layerbus submit --task summarize` with the
default model) and kept in --folder, so a later run measures the same store. Each measurement runs in a
fresh process: its peak RSS is job_workload's own (plus Python, the imports and the tokenizer, which
`idle_rss_mb` gives alone). Writes bench/results/bench_job_workload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "bench_job_workload.json"


def make_job(folder: Path, items: int) -> tuple[str, str]:
    """(store URL, job id) of a job of `items` documents in `folder`, submitted once and reused."""
    from bench.bench_store_scale import layerbus, write_documents

    folder.mkdir(parents=True, exist_ok=True)
    made = folder / "job.json"
    if made.exists():
        saved = json.loads(made.read_text())
        if saved["items"] == items:
            return saved["url"], saved["job_id"]
        raise SystemExit(f"{folder} holds a job of {saved['items']} items, not {items}: use another --folder")
    url = f"sqlite:///{folder / 'jobs.db'}"
    documents = folder / "documents.jsonl"
    write_documents(documents, items)
    env = {**os.environ, "LAYERBUS_HOME": str(folder / "home")}
    seconds, done = layerbus("submit", str(documents), "--task", "summarize", "--db", url, env=env)
    if done.returncode != 0:
        raise SystemExit(f"submit failed:\n{done.stderr}")
    job_id = done.stdout.split()[0]
    made.write_text(json.dumps({"url": url, "job_id": job_id, "items": items, "submit_s": seconds}))
    documents.unlink()
    return url, job_id


def rss_mb() -> float:
    """This process's resident memory now (its peak, ru_maxrss, hides growth below an earlier peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(url: str, job_id: str) -> dict[str, Any]:
    """In this process: load the tokenizer, then time job_workload and price its shape."""
    from layerbus.planner.batching import BatchingConfig
    from layerbus.broker.job_simulation import job_shape
    from layerbus.jobs.job_workload import job_workload
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer
    from layerbus.storage import JobStore

    tokenizer = load_tokenizer(default_model_dir())
    with JobStore.open(url) as store:
        idle_rss_mb, rss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rss_mb()
        wall, cpu = time.perf_counter(), time.process_time()
        workload = job_workload(store, job_id, tokenizer)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak_rss_mb, rss_after_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rss_mb()
    assert workload is not None
    batching = BatchingConfig(micro_batch_size=32, num_micro_batches=4, max_step_tokens=256).resolved(4)
    start = time.perf_counter()
    shape = job_shape(workload, batching)
    shape_s = time.perf_counter() - start
    total = shape.total
    return {"job_workload_s": wall, "job_workload_cpu_s": cpu, "idle_rss_mb": idle_rss_mb, "peak_rss_mb": peak_rss_mb,
            "rss_before_mb": rss_before_mb, "rss_after_mb": rss_after_mb,
            "describe": workload.describe(), "items": workload.items,
            "sampled": len(workload.prompt_lengths), "job_shape_s": shape_s,
            "shape": {"steps": total.steps, "prefill_tokens": total.prefill_tokens, "decode_rows": total.decode_rows,
                      "new_tokens": shape.new_tokens}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--folder", type=Path, required=True, help="where the job's store is made and kept")
    parser.add_argument("--label", default="now", help="key of this measurement in the results file")
    parser.add_argument("--measure", nargs=2, metavar=("URL", "JOB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    url, job_id = make_job(args.folder, args.items)
    done = subprocess.run([sys.executable, __file__, "--folder", str(args.folder), "--measure", url, job_id],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"measuring failed:\n{done.stderr}")
    result = {"items": args.items, **json.loads(done.stdout.splitlines()[-1])}
    for key, value in result.items():
        print(f"{key:<20} {value}")
    saved = json.loads(RESULTS_PATH.read_text()) if RESULTS_PATH.exists() else {}
    saved.setdefault("runs", {})[f"{args.label}/{args.items}"] = result
    saved["machine"] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    RESULTS_PATH.write_text(json.dumps(saved, indent=2) + "\n")
    print(f"\nwrote {RESULTS_PATH}")


if __name__ == "__main__":
    main()
