"""Job-store benchmark: submit 10,000 items, drain them the way a broker does, and time the store alone.

    .venv/bin/python bench/bench_store.py [--items 10000] [--batch 64] [--db URL]

Prints a table and writes bench/results/bench_store.json. With --items 100000 or more it runs the scale
mode instead (bench/bench_store_scale.py: the whole `layerbus submit` of that many documents, then status,
results and cancel beside their targets; writes bench/results/bench_store_scale.json). The functions are meant to be reused by
the end-to-end benchmark: each takes an open JobStore and returns plain numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from layerbus.storage.records import ItemResult, JobSettings, NewItem  # noqa: E402
from layerbus.storage.store import JobStore  # noqa: E402
from bench.bench_store_scale import RESULTS_PATH as SCALE_RESULTS_PATH  # noqa: E402
from bench.bench_store_scale import SCALE_ITEMS, print_scale_table, run_scale_bench  # noqa: E402

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "bench_store.json"
# `layerbus status` polls job_status: it should answer within this on a job of 10,000 items, 3,000
# of them done (what the store contract suite once asserted, where a busy machine made it flaky).
JOB_STATUS_TARGET_MS = 100.0
# A summarize-sized item: ~1 kB of document, a prompt wrapping it, and a ~400-character answer.
_DOCUMENT = "The quarterly report shows steady growth across all regions. " * 16
_OUTPUT = "Revenue grew steadily in every region; costs stayed flat. " * 7


def make_items(count: int) -> list[NewItem]:
    return [
        NewItem(f"doc-{i:06d}", _DOCUMENT, f"Summarize the following text:\n\n{_DOCUMENT}", {"max_tokens": 128}, i)
        for i in range(count)
    ]


def time_submit(store: JobStore, count: int) -> tuple[str, float]:
    """Submit `count` items as one job; returns the job id and the seconds create_job took."""
    items = make_items(count)
    start = time.perf_counter()
    job_id = store.create_job(JobSettings(task="summarize", model="bench-model", name="bench"), items)
    return job_id, time.perf_counter() - start


def time_claim_complete(store: JobStore, job_id: str, batch: int) -> dict[str, float]:
    """Claim `batch` items and complete them, as a broker does, until the job is drained; store time only."""
    claim_s = complete_s = 0.0
    done = 0
    while True:
        start = time.perf_counter()
        claimed = store.claim_items(job_id, "bench-worker", batch)
        claim_s += time.perf_counter() - start
        if not claimed:
            break
        results = [ItemResult(c.item_id, _OUTPUT, "stop", 300, 100, 1.5) for c in claimed]
        start = time.perf_counter()
        store.complete_items(results)
        complete_s += time.perf_counter() - start
        done += len(claimed)
    return {
        "items": done,
        "claim_ms_per_item": 1000 * claim_s / done,
        "complete_ms_per_item": 1000 * complete_s / done,
        "store_ms_per_item": 1000 * (claim_s + complete_s) / done,
        "drain_s": claim_s + complete_s,
    }


def time_job_status(store: JobStore, job_id: str, calls: int = 20) -> float:
    """Median milliseconds of job_status over `calls` calls."""
    timings = []
    for _ in range(calls):
        start = time.perf_counter()
        store.job_status(job_id)
        timings.append(time.perf_counter() - start)
    return 1000 * statistics.median(timings)


def time_job_status_partly_done(store: JobStore, count: int, done: int) -> float:
    """Median milliseconds of job_status on a new job of `count` items with `done` of them completed."""
    job_id, _ = time_submit(store, count)
    claimed = store.claim_items(job_id, "bench-worker", done)
    store.complete_items([ItemResult(c.item_id, _OUTPUT, "stop", 300, 100, 1.5) for c in claimed])
    return time_job_status(store, job_id)


def sqlite_size_bytes(db_path: Path) -> int:
    """The database file plus its WAL and shared-memory files, as they sit on disk."""
    files = [db_path, db_path.with_name(db_path.name + "-wal"), db_path.with_name(db_path.name + "-shm")]
    return sum(f.stat().st_size for f in files if f.exists())


def run_store_bench(url: str, count: int, batch: int, db_path: Path | None) -> dict[str, Any]:
    with JobStore.open(url) as store:
        job_id, submit_s = time_submit(store, count)
        status_queued_ms = time_job_status(store, job_id)
        drain = time_claim_complete(store, job_id, batch)
        status_done_ms = time_job_status(store, job_id)
        partly_done = (count * 3) // 10
        status_partly_ms = time_job_status_partly_done(store, count, partly_done)
    return {
        "url": store.url,
        "items": count,
        "batch": batch,
        "submit_s": submit_s,
        "job_status_ms_median_queued": status_queued_ms,
        "job_status_ms_median_done": status_done_ms,
        "job_status_partly_done_items": partly_done,
        "job_status_ms_median_partly_done": status_partly_ms,
        "job_status_target_ms": JOB_STATUS_TARGET_MS,
        **drain,
        "store_bytes": sqlite_size_bytes(db_path) if db_path else None,
    }


def print_table(result: dict[str, Any]) -> None:
    size = f"{result['store_bytes'] / 2**20:.1f} MiB" if result["store_bytes"] is not None else "n/a"
    partly, target = result["job_status_ms_median_partly_done"], result["job_status_target_ms"]
    rows = [
        ("store", result["url"]),
        ("items / batch", f"{result['items']} / {result['batch']}"),
        ("store size on disk", size),
        ("create_job", f"{result['submit_s'] * 1000:.0f} ms"),
        ("job_status median (all queued)", f"{result['job_status_ms_median_queued']:.2f} ms"),
        ("job_status median (all done)", f"{result['job_status_ms_median_done']:.2f} ms"),
        (f"job_status median ({result['job_status_partly_done_items']} done)",
         f"{partly:.2f} ms ({'within' if partly < target else 'OVER'} the {target:.0f} ms target)"),
        ("claim ms / item", f"{result['claim_ms_per_item']:.3f}"),
        ("complete ms / item", f"{result['complete_ms_per_item']:.3f}"),
        ("claim+complete ms / item", f"{result['store_ms_per_item']:.3f}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def write_json(payload: dict[str, Any], path: Path = RESULTS_PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=64, help="items per claim, as the broker claims")
    parser.add_argument("--db", help="database URL; default: a fresh SQLite file in a temporary folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.items >= SCALE_ITEMS:
        return scale_main(args)
    args.out = args.out or RESULTS_PATH
    with tempfile.TemporaryDirectory(prefix="layerbus-bench-") as folder:
        db_path = None if args.db else Path(folder) / "bench.db"
        url = args.db or f"sqlite:///{db_path}"
        result = run_store_bench(url, args.items, args.batch, db_path)
    print_table(result)
    machine = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    write_json({"store": result, "machine": machine}, args.out)
    print(f"\nwrote {args.out}")


def scale_main(args: argparse.Namespace) -> None:
    machine = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="layerbus-bench-scale-") as folder:
        db_path = None if args.db else Path(folder) / "bench.db"
        url = args.db or f"sqlite:///{db_path}"
        result = run_scale_bench(url, args.items, Path(folder), db_path)
    print_scale_table(result)
    out = args.out or SCALE_RESULTS_PATH
    write_json({"store_scale": result, "machine": machine}, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
