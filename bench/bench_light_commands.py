"""The read-only commands' whole-command times (target: under 100 ms), wall clock and CPU, beside the
interpreter's own start.

    .venv/bin/python bench/bench_light_commands.py [--db URL] [--runs 15] [--out PATH]

Without --db: a fresh SQLite store in a temporary folder. The store holds one 40-item job (a few
completed, as a running job has) made through JobStore, so no model is needed. Each command runs as
a user runs it, the console script in a new process, `--runs` times, interleaved (a burst of load on
this shared machine then hits every command alike); its CPU time is the child's user + system time,
which load on other cores barely changes, while the wall clock also counts waiting for a core. Writes
bench/results/bench_light_commands.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from layerbus.storage.records import ItemResult, JobSettings, NewItem
from layerbus.storage.store import JobStore

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "bench_light_commands.json"
TARGET_MS = 100
LAYERBUS = Path(sys.executable).with_name("layerbus")


def make_job(url: str) -> str:
    with JobStore.open(url) as store:
        items = [NewItem(f"doc-{i}", f"document {i}", f"prompt {i}", {}, i) for i in range(40)]
        job_id = store.create_job(JobSettings(task="summarize", model="bench-model", name="light"), items)
        claimed = store.claim_items(job_id, "bench-worker", 10)
        store.complete_items([ItemResult(c.item_id, "a summary", "stop", 30, 12, 0.5) for c in claimed])
    return job_id


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `command`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run(url: str, runs: int, home: Path) -> dict[str, Any]:
    job_id = make_job(url)
    env = {**os.environ, "LAYERBUS_HOME": str(home)}
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "layerbus --help": [str(LAYERBUS), "--help"],
        "layerbus status": [str(LAYERBUS), "status", "--db", url],
        "layerbus status JOB": [str(LAYERBUS), "status", job_id, "--db", url],
        "layerbus results JOB": [str(LAYERBUS), "results", job_id, "--db", url],
        "layerbus top JOB --once": [str(LAYERBUS), "top", job_id, "--once", "--db", url],
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    load_before = os.getloadavg()[0]
    for _ in range(runs):
        for name, command in commands.items():
            samples[name].append(timed(command, env))
    out: dict[str, Any] = {"url": url if not url.startswith("sqlite") else "sqlite (temporary file)", "runs": runs,
                           "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
                           "commands": {}}
    for name, values in samples.items():
        walls, cpus = [w for w, _ in values], [c for _, c in values]
        out["commands"][name] = {"wall_ms_median": 1000 * statistics.median(walls), "wall_ms_min": 1000 * min(walls),
                                 "cpu_ms_median": 1000 * statistics.median(cpus)}
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"store: {result['url']}; {result['runs']} runs each, interleaved; 1-min load average "
          f"{result['load_average_before']:.1f} -> {result['load_average_after']:.1f} on {os.cpu_count()} CPUs")
    print(f"{'command':<26}{'wall median':>12}{'wall min':>10}{'CPU median':>12}  target < {TARGET_MS} ms (wall median)")
    for name, figures in result["commands"].items():
        wall = figures["wall_ms_median"]
        verdict = "" if name == "python -c pass" else ("met" if wall < TARGET_MS else "MISSED")
        print(f"{name:<26}{wall:>10.0f}ms{figures['wall_ms_min']:>8.0f}ms{figures['cpu_ms_median']:>10.0f}ms  {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="database URL; default: a fresh SQLite file in a temporary folder")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="layerbus-bench-light-") as folder:
        url = args.db or f"sqlite:///{Path(folder) / 'store.db'}"
        result = run(url, args.runs, Path(folder) / "home")
    print_table(result)
    machine = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"light_commands": result, "machine": machine}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
