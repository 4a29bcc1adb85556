"""How long local stages take to start: forked from the launcher that imported their libraries once
(the default, launch.stage_launcher) against a fresh interpreter each (LAYERBUS_FORK_STAGES=0).

Each round runs `layerbus plan --stages N` on the default model as a subprocess (it starts N local
stages, waits until each has registered, loaded its span and profiled itself, prints the plan and
stops them), forked and fresh in turn (fork, fresh, fresh, fork, ...), so a drift of the machine's
load falls on both alike. The profiles and co-run factors are cached in the home from an untimed
first run, so a round is mostly start-up. Whole command: wall time, and the CPU time of the command
and every process it started (getrusage of the children).

    .venv/bin/python bench/bench_startup.py [--pairs 3] [--stages 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_pipeline import RESULTS_DIR  # noqa: E402


def plan_once(layerbus: str, model: Path, stages: int, env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (its own and its children's) of one `layerbus plan`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([layerbus, "plan", "--stages", str(stages), "--model", str(model), "--json"], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="rounds forked, and as many fresh")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_startup.json")
    args = parser.parse_args()

    from layerbus.models.default_model import default_model_dir

    model = default_model_dir()
    layerbus = str(Path(sys.executable).with_name("layerbus"))
    home = Path(tempfile.mkdtemp(prefix="layerbus-bench-startup-"))
    base = dict(os.environ, LAYERBUS_HOME=str(home))
    base.pop("LAYERBUS_PROFILE_CACHE", None)
    plan_once(layerbus, model, args.stages, base)  # untimed: fills the home's profile and co-run caches
    order = [fork for pair in range(args.pairs) for fork in ((True, False) if pair % 2 == 0 else (False, True))]
    runs = []
    for fork in order:
        wall, cpu = plan_once(layerbus, model, args.stages, dict(base, LAYERBUS_FORK_STAGES="1" if fork else "0"))
        runs.append({"fork": fork, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
        print(f"  {'forked' if fork else 'fresh '}: {wall:6.2f} s wall, {cpu:6.2f} s CPU", flush=True)

    def median(fork: bool, key: str) -> float:
        return statistics.median(run[key] for run in runs if run["fork"] == fork)

    summary = {way: {"wall_s": median(fork, "wall_s"), "cpu_s": median(fork, "cpu_s")}
               for way, fork in (("forked", True), ("fresh", False))}
    print(f"\n`layerbus plan --stages {args.stages}` on {model.name} (profiles cached), median of {args.pairs}:")
    print("| stages started | wall | CPU (command and its processes) |")
    print("|---|---|---|")
    for way in ("forked", "fresh"):
        print(f"| {way} | {summary[way]['wall_s']:.2f} s | {summary[way]['cpu_s']:.2f} s |")
    print(f"forked / fresh: wall {summary['forked']['wall_s'] / summary['fresh']['wall_s']:.2f}x, "
          f"CPU {summary['forked']['cpu_s'] / summary['fresh']['cpu_s']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"stages": args.stages, "model": model.name, "cpus": os.cpu_count(),
                                    "load_average": os.getloadavg(), "runs": runs, "median": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
