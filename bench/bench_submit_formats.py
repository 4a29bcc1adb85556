"""`layerbus submit` of the same corpus as JSON Lines ({"id", "text"}) and as Parquet with a dataset's own
column names (`--id-column doc_id --text-column body`, plus a column it ignores): items/s and peak RSS.

    LAYERBUS_MODEL_CACHE=... .venv/bin/python bench/bench_submit_formats.py --items 1000000

Each submit runs as a user runs it (a new process, Python start-up included), into its own fresh SQLite
store; the order alternates so neither format always runs on a warmer machine. Writes
bench/results/bench_submit_formats.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.bench_store_scale import DOCUMENT_WORDS, _WORDS

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "bench_submit_formats.json"
# The child's peak RSS, measured by a wrapper process around it (ru_maxrss of its one child, in KiB).
_PEAK_RSS = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")


def documents(count: int, seed: int = 0):
    rng = random.Random(seed)
    for n in range(count):
        yield f"doc-{n:07d}", " ".join(rng.choices(_WORDS, k=DOCUMENT_WORDS))


def write_inputs(folder: Path, count: int, batch: int = 50_000) -> tuple[Path, Path]:
    jsonl, parquet = folder / "corpus.jsonl", folder / "corpus.parquet"
    schema = pa.schema([("doc_id", pa.string()), ("body", pa.string()), ("highlights", pa.string())])
    with jsonl.open("w") as out, pq.ParquetWriter(parquet, schema) as writer:
        rows = []
        for doc_id, text in documents(count):
            out.write(json.dumps({"id": doc_id, "text": text}) + "\n")
            rows.append((doc_id, text))
            if len(rows) == batch or doc_id == f"doc-{count - 1:07d}":
                ids, texts = zip(*rows)
                writer.write_table(pa.table({"doc_id": ids, "body": texts, "highlights": [t[:40] for t in texts]},
                                            schema=schema))
                rows = []
    return jsonl, parquet


def submit(input_path: Path, options: list[str], folder: Path, model: str | None) -> dict:
    db = f"sqlite:///{folder / f'{input_path.suffix[1:]}-{time.monotonic_ns()}.db'}"
    args = [sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "layerbus.cli.main", "submit", str(input_path),
            "--task", "summarize", "--db", db, *options, *(["--model", model] if model else [])]
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"submit {input_path} exited {done.returncode}:\n{done.stderr[-2000:]}")
    peak_kib = int(done.stderr.strip().splitlines()[-1])
    return {"seconds": round(seconds, 2), "peak_rss_mb": round(peak_kib / 1024, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-submit-formats-") as tmp:
        folder = Path(tmp)
        jsonl, parquet = write_inputs(folder, args.items)
        runs = {"jsonl": [], "parquet": []}
        cases = [("jsonl", jsonl, []), ("parquet", parquet, ["--id-column", "doc_id", "--text-column", "body"])]
        for order in (cases, cases[::-1]):
            for name, path, options in order:
                runs[name].append(submit(path, options, folder, args.model))
        sizes = {"jsonl_mb": round(jsonl.stat().st_size / 2**20, 1), "parquet_mb": round(parquet.stat().st_size / 2**20, 1)}
    result = {"items": args.items, "input_sizes": sizes, "runs": runs}
    for name, measured in runs.items():
        best = min(run["seconds"] for run in measured)
        result[name] = {"items_per_s": round(args.items / best), "peak_rss_mb": max(r["peak_rss_mb"] for r in measured)}
    print(f"{args.items:,} items: " + "; ".join(
        f"{name} {result[name]['items_per_s']:,} items/s, peak RSS {result[name]['peak_rss_mb']} MB"
        for name in runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
