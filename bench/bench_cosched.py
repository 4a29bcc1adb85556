"""How one-thread CPU steps share this machine's cores when they start together (what the plan must
price for CPU stages that share a host): N processes each run a one-thread step of a fixed amount of
work, either each at its own pace ("free", as the co-run probe serves its steps) or all started at the
same wall-clock ticks ("in step", as a ring of as many micro-batches as stages starts them). It prints each mode's step
time over the step alone, per process (the median) and, in step, per tick (the slowest of the N: what
the ring waits for), at a short and a long step.

The step is torch matmuls on a small matrix that stays in cache, so what it measures is the kernel's
sharing of the cores, not memory bandwidth: with 3 processes on 2 cores an even share is 1.5x.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_cosched.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "bench_cosched.json"


_INPUTS: list = []


def _step(repeats: int) -> None:
    import torch

    if not _INPUTS:  # made once per process, before any step is timed
        torch.set_num_threads(1)
        _INPUTS.extend([torch.randn(576, 576, generator=torch.Generator().manual_seed(0)),
                        torch.randn(14, 576, generator=torch.Generator().manual_seed(1))])
    matrix, rows = _INPUTS
    for _ in range(repeats):
        rows = torch.tanh(rows @ matrix)


def _repeats_for(seconds: float) -> int:
    """Matmul repeats that take about `seconds` alone on this machine."""
    _step(1)  # torch imported and the inputs made first: not timed
    repeats = 50
    while True:
        started = time.perf_counter()
        _step(repeats)
        took = time.perf_counter() - started
        if took > 0.01:
            return max(1, int(repeats * seconds / took))
        repeats *= 2


def _worker(repeats: int, in_step: bool, start: float, period: float, ticks: int, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    _step(1)  # torch imported and the inputs made before the clock starts
    steps = []
    if in_step:
        for tick in range(ticks):
            at = start + tick * period
            while time.time() < at:
                time.sleep(max(0.0, min(0.001, at - time.time())))
            began = time.perf_counter()
            _step(repeats)
            steps.append(time.perf_counter() - began)
    else:
        while time.time() < start:
            time.sleep(0.001)
        while time.time() < start + ticks * period:
            began = time.perf_counter()
            _step(repeats)
            steps.append(time.perf_counter() - began)
    out.put(steps)


def _run(repeats: int, processes: int, in_step: bool, period: float, ticks: int) -> list[list[float]]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    start = time.time() + 4.0  # every process has imported torch by then
    workers = [context.Process(target=_worker, args=(repeats, in_step, start, period, ticks, queue))
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps-ms", type=float, nargs="+", default=[15.0, 45.0])
    parser.add_argument("--ticks", type=int, default=40)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for step_ms in args.steps_ms:
        repeats = _repeats_for(step_ms / 1000)
        period = 3 * step_ms / 1000  # room for the slowest sharing
        alone = statistics.median(_run(repeats, 1, True, period, args.ticks)[0][1:])
        free = _run(repeats, args.processes, False, period, args.ticks)
        in_step = _run(repeats, args.processes, True, period, args.ticks)
        ticks = min(len(steps) for steps in in_step)
        rows.append({
            "step_ms": step_ms, "alone_ms": alone * 1e3,
            "free_per_process": statistics.median(s for steps in free for s in steps[1:]) / alone,
            "in_step_per_process": statistics.median(s for steps in in_step for s in steps[1:]) / alone,
            "in_step_slowest": statistics.median(max(steps[k] for steps in in_step) for k in range(1, ticks)) / alone,
        })
    print(f"\n{args.processes} one-thread processes on {os.cpu_count()} cores; step time over alone (median)\n")
    print("| step | alone ms | free, per process | in step, per process | in step, slowest per tick |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['step_ms']:.0f} ms | {row['alone_ms']:.1f} | {row['free_per_process']:.2f}x | "
              f"{row['in_step_per_process']:.2f}x | {row['in_step_slowest']:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"processes": args.processes, "cores": os.cpu_count(), "rows": rows}, indent=2))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
