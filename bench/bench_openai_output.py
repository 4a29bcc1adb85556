"""`layerbus results JOB --format openai` on finished jobs of growing size: wall time, lines per
second and the command's peak memory (the files are streamed, so memory must not grow with
the job).

    .venv/bin/python bench/bench_openai_output.py [--items 10000,100000] [--out PATH]

Each job is made in a fresh SQLite file through JobStore (no model needed): every item completed with a
200-character output, except one in 50 failed. The command runs as a user runs it, the console script in
a new process; its peak RSS is the child's own VmHWM, read from /proc while it runs. Writes
bench/results/bench_openai_output.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from layerbus.storage.records import ItemResult, JobSettings, NewItem
from layerbus.storage.store import JobStore

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "bench_openai_output.json"
LAYERBUS = Path(sys.executable).with_name("layerbus")
CHUNK = 5000
OUTPUT_TEXT = ("The broker hands each batch to the first stage, which passes its activations on. " * 3)[:200]


def make_job(url: str, count: int) -> str:
    with JobStore.open(url) as store:
        items = [NewItem(f"req-{i:07d}", f"document {i}", f"prompt {i}", {"endpoint": "/v1/chat/completions"}, i + 1)
                 for i in range(count)]
        job_id = store.create_job(JobSettings(task="generate", model="bench-model", name="openai-out"), items)
        while claimed := store.claim_items(job_id, "bench-worker", CHUNK):
            store.complete_items([
                ItemResult(c.item_id, None, "error", 40, 0, 0.0, error="prompt too long") if c.seq % 50 == 0
                else ItemResult(c.item_id, OUTPUT_TEXT, "stop", 40, 48, 0.5) for c in claimed])
        store.set_job_status(job_id, "finalizing")
        store.set_results_path(job_id, Path(url.removeprefix("sqlite:///")).with_suffix(".parquet"))
        store.set_job_status(job_id, "completed")
    return job_id


def measure(url: str, job_id: str, folder: Path, env: dict[str, str]) -> dict[str, Any]:
    output, errors = folder / "output.jsonl", folder / "errors.jsonl"
    command = [str(LAYERBUS), "results", job_id, "--format", "openai", "--output", str(output), "--errors",
               str(errors), "--db", url]
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak_kb = 0
    while process.poll() is None:  # the child's own high-water mark, read while it runs (see peak_rss_kb)
        peak_kb = max(peak_kb, peak_rss_kb(process.pid))
        time.sleep(0.005)
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"the command failed ({process.returncode}): {' '.join(command)}")
    lines = sum(1 for _ in output.open()) + sum(1 for _ in errors.open())
    return {"wall_s": round(wall, 3), "peak_rss_mb": round(peak_kb / 1024, 1), "lines": lines,
            "lines_per_s": round(lines / wall), "output_mb": round(output.stat().st_size / 2**20, 1)}


def peak_rss_kb(pid: int) -> int:
    """VmHWM of `pid` (0 once it has exited). Not ru_maxrss from wait4: Linux carries the forking
    process's high-water mark across fork and exec into it, so a bench that built a 100,000-item job
    would be charged to the command."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", default="10000,100000", help="job sizes, comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args(argv)
    rows = []
    for count in (int(n) for n in args.items.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            url = f"sqlite:///{folder / 'jobs.db'}"
            job_id = make_job(url, count)
            env = {**os.environ, "LAYERBUS_HOME": str(folder / "home")}
            rows.append({"items": count, **measure(url, job_id, folder, env)})
    print(f"{'items':>8}  {'wall s':>7}  {'lines/s':>8}  {'peak RSS MB':>11}  {'output MB':>9}")
    for row in rows:
        print(f"{row['items']:>8}  {row['wall_s']:>7}  {row['lines_per_s']:>8}  "
              f"{row['peak_rss_mb']:>11}  {row['output_mb']:>9}")
    result = {"bench": "openai_output", "python": platform.python_version(), "load_avg": os.getloadavg(),
              "cpus": os.cpu_count(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
