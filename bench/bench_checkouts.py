"""Pipeline throughput of two checkouts of layerbus, side by side in one run.

A refactor or an engine change is judged by its ratio to the code before it, measured on the same
machine at the same time (this machine is shared and noisy; figures from different runs are not
comparable). Each checkout runs its own `bench/bench_pipeline.py --skip-baseline` with its own
`.venv`, alternating between the two for --rounds rounds so slow drifts in the machine's load hit
both alike. Each checkout gets its own LAYERBUS_HOME (its own profile cache); both read one model.

    git worktree add /tmp/old <commit> && (cd /tmp/old && ./setup.sh)
    .venv/bin/python bench/bench_checkouts.py /tmp/old . -- --prompts 32 --stages 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run_pipeline_bench(checkout: Path, home: Path, bench_args: list[str]) -> list[dict]:
    """One `bench_pipeline.py` run of `checkout`; its layerbus rows."""
    python = checkout / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{checkout}: no .venv/bin/python; run ./setup.sh in that checkout first")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([str(python), str(checkout / "bench" / "bench_pipeline.py"), "--skip-baseline",
                        *bench_args, "--out", out.name],
                       check=True, cwd=checkout, env={**os.environ, "LAYERBUS_HOME": str(home)})
        return json.loads(Path(out.name).read_text())["rows"]


def summarize(runs: dict[str, list[list[dict]]]) -> dict[str, dict[str, list[float]]]:
    """{checkout label: {system: [useful tok/s per round]}}."""
    table: dict[str, dict[str, list[float]]] = {}
    for label, rounds in runs.items():
        for rows in rounds:
            for row in rows:
                table.setdefault(label, {}).setdefault(row["system"], []).append(row["useful_tok_s"])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="the checkout before the change (with its own .venv)")
    parser.add_argument("new", type=Path, help="the checkout after the change (with its own .venv)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each checkout (2)")
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the default model)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_checkouts.json")
    # What follows `--` goes to bench_pipeline.py untouched (argparse's REMAINDER would also swallow
    # this script's own options when they come after the two checkouts).
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from layerbus.models.default_model import default_model_dir

        args.model = default_model_dir()
    bench_args += ["--model", str(args.model)]
    checkouts = {"old": args.old.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[list[dict]]] = {label: [] for label in checkouts}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            # Alternate which checkout goes first, so neither always runs on the warmer machine.
            order = list(checkouts) if round_index % 2 == 0 else list(reversed(checkouts))
            for label in order:
                print(f"round {round_index + 1}/{args.rounds}: {label} ({checkouts[label]})", flush=True)
                runs[label].append(run_pipeline_bench(checkouts[label], Path(scratch) / label, bench_args))
    table = summarize(runs)
    report = {"checkouts": {k: str(v) for k, v in checkouts.items()}, "bench_args": bench_args,
              "rounds": args.rounds, "useful_tok_s": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("\n| system | old tok/s (each round) | new tok/s (each round) | new / old (medians) |")
    print("|---|---|---|---|")
    for system in table["old"]:
        old, new = table["old"][system], table["new"].get(system, [])
        ratio = statistics.median(new) / statistics.median(old) if new else float("nan")
        print(f"| {system} | {', '.join(f'{v:.1f}' for v in old)} | {', '.join(f'{v:.1f}' for v in new)} | {ratio:.3f} |")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
