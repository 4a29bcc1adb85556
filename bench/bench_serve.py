"""`layerbus serve` at a million lines: an OpenAI batch input of 1,000,000 chat lines uploaded through HTTP
(POST /v1/files, multipart, streamed from disk), its lines/s and the server's peak memory; then the batch created
from it (its million items validated into the store), and how long GET /v1/batches/{id} and the dashboard's pages
take with those items in the store. Each figure beside its target.

    LAYERBUS_MODEL_CACHE=... .venv/bin/python bench/bench_serve.py [--lines 1000000]

The lines name the default model (SmolLM2-135M-Instruct), prepared in LAYERBUS_MODEL_CACHE. The server runs as a
subprocess, as a user runs it, on a store in a temporary folder. Writes bench/results/bench_serve.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "bench_serve.json"
UPLOAD_LINES_PER_S_TARGET = 15_000
SERVER_PEAK_MB_TARGET = 500
GET_BATCH_MS_TARGET = 50
PAGE_MS_TARGET = 300
MODEL = "SmolLM2-135M-Instruct"
BOUNDARY = "layerbus-bench-boundary"
_WORDS = "the report market growth region team quarter product customer revenue cost plan risk data".split()


def write_batch_input(path: Path, lines: int, seed: int = 0) -> int:
    """`lines` OpenAI chat lines of about 30 words each; returns the file's size in bytes."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for n in range(lines):
            content = "Summarize: " + " ".join(rng.choices(_WORDS, k=30))
            out.write(json.dumps({"custom_id": f"req-{n:07d}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                           "max_tokens": 16}}) + "\n")
    return path.stat().st_size


def start_server(folder: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "LAYERBUS_HOME": str(folder / "home")}
    log = open(folder / "serve.log", "w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "layerbus"), "serve", "--db",
                               f"sqlite:///{folder / 'jobs.db'}", "--bind", f"127.0.0.1:{port}"], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "listening on" not in (folder / "serve.log").read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"layerbus serve did not start:\n{(folder / 'serve.log').read_text()}")
        time.sleep(0.1)
    return server


def upload(port: int, path: Path) -> dict[str, Any]:
    """POST the file as multipart/form-data, streamed from disk in 1 MiB chunks (as curl -F does)."""
    head = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n'
            f'Content-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode()
    tail = f"\r\n--{BOUNDARY}--\r\n".encode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.putrequest("POST", "/v1/files")
    connection.putheader("Content-Type", f"multipart/form-data; boundary={BOUNDARY}")
    connection.putheader("Content-Length", str(len(head) + path.stat().st_size + len(tail)))
    connection.putheader("Authorization", "Bearer bench")
    connection.endheaders()
    connection.send(head)
    with path.open("rb") as data:
        while chunk := data.read(1 << 20):
            connection.send(chunk)
    connection.send(tail)
    response = connection.getresponse()
    body = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"upload refused: {response.status} {body}")
    return body


def call(port: int, method: str, path: str, body: dict | None = None) -> tuple[float, int, bytes]:
    """(milliseconds, status, body) of one request on a new connection, as a client polling does."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": "Bearer bench", **({"Content-Type": "application/json"} if data else {})}
    start = time.perf_counter()
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    payload = response.read()
    elapsed = (time.perf_counter() - start) * 1000
    connection.close()
    return elapsed, response.status, payload


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def median_ms(port: int, path: str, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        elapsed, status, payload = call(port, "GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {payload[:300]!r}")
        times.append(elapsed)
    return statistics.median(times)


def wait_for_batch(port: int, batch_id: str, timeout_s: float) -> tuple[dict, float]:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        _, _, payload = call(port, "GET", f"/v1/batches/{batch_id}")
        batch = json.loads(payload)
        if batch["status"] != "validating":
            return batch, time.monotonic() - start
        time.sleep(1)
    raise RuntimeError(f"batch {batch_id} still validating after {timeout_s} s")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(lines: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        folder = Path(tmp)
        size = write_batch_input(folder / "batch.jsonl", lines)
        port = free_port()
        server = start_server(folder, port)
        try:
            rss_before = peak_rss_mb(server.pid)
            start = time.perf_counter()
            uploaded = upload(port, folder / "batch.jsonl")
            upload_s = time.perf_counter() - start
            rss_upload = peak_rss_mb(server.pid)
            assert uploaded["bytes"] == size, uploaded
            _, status, payload = call(port, "POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint":
                                                                    "/v1/chat/completions", "completion_window": "24h"})
            batch = json.loads(payload)
            if status != 200:
                raise RuntimeError(f"batch refused: {status} {batch}")
            batch, validate_s = wait_for_batch(port, batch["id"], 3600)
            if batch["status"] != "in_progress" or batch["request_counts"]["total"] != lines:
                raise RuntimeError(f"the batch did not take every line: {batch}")
            get_ms = median_ms(port, f"/v1/batches/{batch['id']}", rounds)
            list_ms = median_ms(port, "/v1/batches?limit=20", rounds)
            _, _, jobs_page = call(port, "GET", "/")
            job_id = jobs_page.decode().split('href="/jobs/')[1].split('"')[0]
            pages_ms = {"/": median_ms(port, "/", rounds), "/jobs/JOB": median_ms(port, f"/jobs/{job_id}", rounds)}
            rss_end = peak_rss_mb(server.pid)
        finally:
            server.terminate()
            server.wait(30)
    return {"lines": lines, "bytes": size, "upload_s": upload_s, "upload_lines_per_s": lines / upload_s,
            "upload_mb_per_s": size / upload_s / 1e6, "server_rss_start_mb": rss_before,
            "server_peak_mb_after_upload": rss_upload, "validate_s": validate_s,
            "validate_lines_per_s": lines / validate_s, "server_peak_mb_end": rss_end, "get_batch_ms": get_ms,
            "list_batches_ms": list_ms, "pages_ms": pages_ms, "rounds": rounds,
            "load": os.getloadavg()[0], "cpus": os.cpu_count()}


def report(result: dict[str, Any]) -> str:
    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    rows = [
        ("upload, lines/s", f"{result['upload_lines_per_s']:,.0f} ({result['upload_mb_per_s']:.0f} MB/s)",
         f">= {UPLOAD_LINES_PER_S_TARGET:,}", mark(result["upload_lines_per_s"] >= UPLOAD_LINES_PER_S_TARGET)),
        ("server peak RSS after the upload", f"{result['server_peak_mb_after_upload']:.0f} MB",
         f"< {SERVER_PEAK_MB_TARGET}", mark(result["server_peak_mb_after_upload"] < SERVER_PEAK_MB_TARGET)),
        ("batch validated into the store", f"{result['validate_s']:.1f} s ({result['validate_lines_per_s']:,.0f}/s)",
         "-", "-"),
        ("server peak RSS at the end", f"{result['server_peak_mb_end']:.0f} MB", "-", "-"),
        (f"GET /v1/batches/ID, {result['lines']:,} items", f"{result['get_batch_ms']:.1f} ms",
         f"< {GET_BATCH_MS_TARGET}", mark(result["get_batch_ms"] < GET_BATCH_MS_TARGET)),
        ("GET /v1/batches", f"{result['list_batches_ms']:.1f} ms", "-", "-"),
        *[(f"page {page}", f"{ms:.1f} ms", f"< {PAGE_MS_TARGET}", mark(ms < PAGE_MS_TARGET))
          for page, ms in result["pages_ms"].items()],
    ]
    width = max(len(row[0]) for row in rows)
    lines = [f"{'what':<{width}}  {'figure':<28} {'target':<10} met?"]
    lines += [f"{what:<{width}}  {figure:<28} {target:<10} {met}" for what, figure, target, met in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=30, help="requests timed per GET (median)")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    result = run(args.lines, args.rounds)
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), **result}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
