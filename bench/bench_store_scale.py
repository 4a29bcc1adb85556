"""The job store at nightly-eval scale: `layerbus submit` of a million short documents, then status, results
and cancel on the store holding them, each beside its target.

    LAYERBUS_MODEL_CACHE=... .venv/bin/python bench/bench_store.py --items 1000000 [--db URL]

bench_store.py runs this for --items of SCALE_ITEMS or more. Commands run as subprocesses, whole (Python
start-up included), as a user runs them; status is also timed in-process (the store's query alone), which
is what the targets are about. Writes bench/results/bench_store_scale.json.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from layerbus.storage.records import JobSettings, NewItem
from layerbus.storage.direct_status import read_job_status, read_recent_jobs
from layerbus.storage.store import JobStore

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "bench_store_scale.json"
# Inputs of this many items or more are measured here rather than by bench_store's store-only run.
SCALE_ITEMS = 100_000
# The targets: submit at 20,000 items/s or more within 500 MB, status within 100 ms, cancel within 2 s.
SUBMIT_ITEMS_PER_S_TARGET = 20_000
SUBMIT_PEAK_RSS_MB_TARGET = 500
STATUS_MS_TARGET = 100
CANCEL_S_TARGET = 2.0
# Words of each document: a short document.
DOCUMENT_WORDS = 60
_WORDS = ("the report market growth region team quarter product customer revenue cost plan risk data model "
          "city river school health energy budget supply demand staff office policy result trend").split()


def write_documents(path: Path, count: int, seed: int = 0) -> int:
    """A JSON Lines file of `count` {"id", "text"} documents of DOCUMENT_WORDS words; returns its size in bytes."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for n in range(count):
            text = " ".join(rng.choices(_WORDS, k=DOCUMENT_WORDS))
            out.write(json.dumps({"id": f"doc-{n:07d}", "text": text}) + "\n")
    return path.stat().st_size


def layerbus(*args: str, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run the layerbus command; (wall seconds, the finished process)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "layerbus.cli.main", *args], capture_output=True, text=True,
                          env=env, check=False)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise RuntimeError(f"layerbus {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return seconds, done


def median_ms(call, times: int = 9) -> float:  # type: ignore[no-untyped-def]
    timings = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        timings.append(time.perf_counter() - start)
    return 1000 * statistics.median(timings)


def run_scale_bench(url: str, count: int, folder: Path, db_path: Path | None) -> dict[str, Any]:
    env = {**os.environ, "LAYERBUS_HOME": str(folder / "home")}
    documents = folder / "documents.jsonl"
    input_bytes = write_documents(documents, count)
    # The submit is this process's first child, so RUSAGE_CHILDREN's peak is the submit's own.
    submit_s, submitted = layerbus("submit", str(documents), "--task", "summarize", "--db", url, env=env)
    if submitted.returncode != 0:
        raise RuntimeError(f"submit failed:\n{submitted.stderr}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    submit_rss_mb, submit_cpu_s = usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime
    job_id = submitted.stdout.split()[0]
    result: dict[str, Any] = {
        "url": url if db_path is None else "sqlite (temporary file)", "items": count, "input_mb": input_bytes / 2**20,
        "submit_s": submit_s, "submit_items_per_s": count / submit_s, "submit_peak_rss_mb": submit_rss_mb,
        # CPU seconds of the submit process: on a shared machine wall time also counts others' work.
        "submit_cpu_s": submit_cpu_s, "submit_items_per_cpu_s": count / submit_cpu_s,
        "load_average_during_submit": os.getloadavg()[0], "store_mb": _store_mb(db_path, url),
    }
    # The same command on an empty SQLite store: what Python and the imports cost, whatever the store holds.
    empty = f"sqlite:///{folder / 'empty.db'}"
    layerbus("status", "--db", empty, env=env)  # creates the empty store
    result["status_command_empty_store_ms"] = 1000 * statistics.median(
        layerbus("status", "--db", empty, env=env)[0] for _ in range(5))
    commands = {"status": ("status", "--db", url), "status_job": ("status", job_id, "--db", url),
                "results": ("results", job_id, "--db", url)}
    for name, args in commands.items():
        result[f"{name}_command_ms"] = 1000 * statistics.median(layerbus(*args, env=env)[0] for _ in range(5))
    with JobStore.open(url) as store:
        result["status_store_ms"] = median_ms(lambda: store.list_jobs())
        result["status_job_store_ms"] = median_ms(lambda: store.job_status(job_id))
        # The path `layerbus status` takes: the driver alone (sqlite3 or psycopg), a fresh connection per call.
        result["status_direct_read_ms"] = median_ms(lambda: read_recent_jobs(url, 20))
        result["status_job_direct_read_ms"] = median_ms(lambda: read_job_status(url, job_id))
        result["cancel_command_s"] = layerbus("cancel", job_id, "--db", url, env=env)[0]
        # The same command on a one-item job in the same store: "about as fast as cancelling a small one".
        small = store.create_job(JobSettings(task="summarize", model="bench-model", name="small"),
                                 [NewItem("one", "a document", "a prompt", {}, 1)])
        result["cancel_small_job_command_s"] = layerbus("cancel", small, "--db", url, env=env)[0]
        status = store.job_status(job_id)
        result["after_cancel"] = {"status": status.status, "cancelled": status.cancelled, "queued": status.queued}
        start = time.perf_counter()
        rows = sum(1 for _ in store.item_results(job_id))
        result["results_rows_read_s"], result["results_rows"] = time.perf_counter() - start, rows
    return result


def _store_mb(db_path: Path | None, url: str) -> float | None:
    if db_path is None and url.startswith("postgresql"):
        from sqlalchemy import create_engine, text

        engine = create_engine(url)
        with engine.connect() as conn:
            size = conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
        engine.dispose()
        return size / 2**20
    if db_path is None:
        return None
    files = [db_path, db_path.with_name(db_path.name + "-wal")]
    return sum(f.stat().st_size for f in files if f.exists()) / 2**20


def print_scale_table(r: dict[str, Any]) -> None:
    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    rss, rate, rate_target = r["submit_peak_rss_mb"], r["submit_items_per_s"], SUBMIT_ITEMS_PER_S_TARGET
    rows = [
        ("store / items", f"{r['url']} / {r['items']:,} ({r['input_mb']:.0f} MB of JSON Lines)"),
        ("submit (whole command)", f"{r['submit_s']:.1f} s = {rate:,.0f} items/s "
                                   f"(target >= {rate_target:,}: {verdict(rate >= rate_target)})"),
        ("submit CPU time", f"{r['submit_cpu_s']:.1f} s = {r['submit_items_per_cpu_s']:,.0f} items per CPU-second "
                            f"(1-min load average {r['load_average_during_submit']:.1f} on {os.cpu_count()} CPUs)"),
        ("submit peak RSS", f"{rss:.0f} MB (target < {SUBMIT_PEAK_RSS_MB_TARGET}: "
                            f"{verdict(rss < SUBMIT_PEAK_RSS_MB_TARGET)})"),
        ("store size", f"{r['store_mb']:.0f} MB" if r["store_mb"] is not None else "n/a"),
    ]
    for name, key in (("status", "status"), ("status JOB", "status_job")):
        query = r.get(f"{key}_direct_read_ms", r[f"{key}_store_ms"])
        command = r[f"{key}_command_ms"]
        rows.append((f"{name}", f"{query:.1f} ms query (target < {STATUS_MS_TARGET}: "
                                f"{verdict(query < STATUS_MS_TARGET)}), {command:.0f} ms whole command "
                                f"(target < {STATUS_MS_TARGET}: {verdict(command < STATUS_MS_TARGET)})"))
    rows += [
        ("status, empty SQLite store", f"{r['status_command_empty_store_ms']:.0f} ms whole command (Python, imports)"),
        ("results JOB (whole command)", f"{r['results_command_ms']:.0f} ms (target < {STATUS_MS_TARGET}: "
                                        f"{verdict(r['results_command_ms'] < STATUS_MS_TARGET)})"),
        ("cancel (whole command)", f"{r['cancel_command_s']:.2f} s (target < {CANCEL_S_TARGET:g}: "
                                   f"{verdict(r['cancel_command_s'] < CANCEL_S_TARGET)}); a one-item job: "
                                   f"{r['cancel_small_job_command_s']:.2f} s"),
        ("after cancel", json.dumps(r["after_cancel"])),
        ("read every result row", f"{r['results_rows']:,} rows in {r['results_rows_read_s']:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
