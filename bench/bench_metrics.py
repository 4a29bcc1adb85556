"""Metrics cost nothing measurable: tokens/s with the --metrics endpoint on and scraped, against
off, side by side on one local cluster (the same stages, the same placement), in alternating rounds
(off, on, off, on, ...) so a drift of the machine's load falls on both alike.

"On" is what `--metrics` adds to a run: the endpoint's HTTP thread, and a scraper fetching /metrics every
--scrape-interval seconds (1 s by default, 15 times Prometheus's default rate), each scrape reading the
stages' stats, the broker's counters and a watched job's status from a SQLite store. The stages' side
(bytes received, memory and the step-time histogram in their heartbeats) is there in both: it is always on.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_metrics.py               # about 2 minutes
    .venv/bin/python bench/bench_metrics.py --model DIR --prompts 8 --rounds 2            # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import tokenized_prompts  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.broker.metrics_server import MetricsServer  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.models.default_model import default_model_dir  # noqa: E402
from layerbus.models.model_info import load_tokenizer  # noqa: E402
from layerbus.storage import JobStore  # noqa: E402
from layerbus.storage.records import JobSettings, NewItem  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class Scraper:
    """Fetches /metrics every `interval_s` from a thread, as Prometheus would; counts what it fetched."""

    def __init__(self, url: str, interval_s: float):
        self.url, self.interval_s = url, interval_s
        self.scrapes, self.bytes, self.seconds = 0, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            began = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=10) as response:
                self.bytes += len(response.read())
            self.seconds += time.perf_counter() - began
            self.scrapes += 1


def one_run(cluster: LocalCluster, requests: list[GenerationRequest], metrics: bool, store: JobStore, job_id: str,
            interval_s: float) -> dict:
    if not metrics:
        results, stats = cluster.broker.generate(requests)
        return {"metrics": False, "tokens_per_s": stats.new_tokens / stats.wall_s, "new_tokens": stats.new_tokens}
    server = MetricsServer("127.0.0.1", 0)
    server.attach(cluster.broker)
    server.watch_job(store, job_id)
    try:
        with Scraper(f"{server.address}/metrics", interval_s) as scraper:
            results, stats = cluster.broker.generate(requests)
    finally:
        server.close()
    return {"metrics": True, "tokens_per_s": stats.new_tokens / stats.wall_s, "new_tokens": stats.new_tokens,
            "scrapes": scraper.scrapes, "scrape_ms": 1e3 * scraper.seconds / max(1, scraper.scrapes),
            "scrape_bytes": scraper.bytes // max(1, scraper.scrapes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs, off then on")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    args = parser.parse_args()

    model = Path(args.model) if args.model else default_model_dir()
    prompts = tokenized_prompts(load_tokenizer(model), args.prompts)
    requests = [GenerationRequest(pid, ids, max_new_tokens=args.max_new_tokens) for pid, ids in prompts]
    config = BrokerConfig(str(model), args.stages, partition="equal",
                          batching=BatchingConfig(micro_batch_size=8, max_context=2048))
    runs = []
    with tempfile.TemporaryDirectory(prefix="layerbus-bench-metrics-") as folder, \
            JobStore.open(f"sqlite:///{folder}/jobs.db") as store, \
            LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
        job_id = store.create_job(JobSettings(task="generate", model=str(model)), [NewItem("a", "a", "a", {}, 0)])
        one_run(cluster, requests[:2], False, store, job_id, args.scrape_interval)  # warm-up, not counted
        for _ in range(args.rounds):
            for metrics in (False, True):
                runs.append(one_run(cluster, requests, metrics, store, job_id, args.scrape_interval))
                print(json.dumps(runs[-1]), flush=True)
    off = [run["tokens_per_s"] for run in runs if not run["metrics"]]
    on = [run["tokens_per_s"] for run in runs if run["metrics"]]
    summary = {"model": model.name, "stages": args.stages, "prompts": args.prompts,
               "max_new_tokens": args.max_new_tokens, "scrape_interval_s": args.scrape_interval,
               "off_tokens_per_s": off, "on_tokens_per_s": on,
               "off_median": statistics.median(off), "on_median": statistics.median(on),
               "on_vs_off": statistics.median(on) / statistics.median(off),
               "off_spread": (max(off) - min(off)) / statistics.median(off), "runs": runs}
    print(f"{'metrics':<8} {'tok/s (median)':>15} {'runs':>30}")
    print(f"{'off':<8} {summary['off_median']:>15.1f} {', '.join(f'{v:.1f}' for v in off):>30}")
    print(f"{'on':<8} {summary['on_median']:>15.1f} {', '.join(f'{v:.1f}' for v in on):>30}")
    print(f"on / off: {summary['on_vs_off']:.3f}; spread of the off runs: {summary['off_spread']:.1%}")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "bench_metrics.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
