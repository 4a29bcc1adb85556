"""Several chains on one job (issue 14): tokens/s of 2 chains of 2 stages against 1 chain of 4, side by side in
one run, on the same job, outputs checked equal.

SmolLM2-135M, four local stages with one thread each at --emulate-speed F (each stage sleeps so that it uses
at most F of a core: four fit this machine's two cores), dense work (bench/corpus.py's story prompts, whose
answers run to the token limit), greedy. Both runs go through the code `layerbus run` uses: run_job_locally
for one chain, cli/chains.py for two (one broker process per chain). Both use --partition balanced
(layers by FLOPs), so every stage holds a span in either shape, and the same micro-batch size; the number of
micro-batches in flight is each broker's own default (stages + 1). tokens/s is the job's own figure, as
`layerbus status` shows it: generated tokens over the time from the job's start (its first claim, once every
chain is placed) to its end; start-up (imports, loading, profiling) is reported apart. The issue's target is
>= 1.6x for the planner's choice against one chain of four.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_chains.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import story_messages  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_corpus(path: Path, count: int, max_new_tokens: int) -> Path:
    with open(path, "w") as handle:
        for custom_id, messages in story_messages(count):
            handle.write(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"messages": messages, "max_tokens": max_new_tokens}}) + "\n")
    return path


def submit(corpus: Path, model_dir: Path, db: str) -> str:
    done = subprocess.run([str(Path(sys.executable).parent / "layerbus"), "submit", str(corpus), "--task", "generate",
                           "--model", str(model_dir), "--db", db], capture_output=True, text=True, check=True)
    return re.search(r"job_[0-9a-f]{12}", done.stdout).group()


def run(chains: int, args: argparse.Namespace, model_dir: Path, corpus: Path, home: Path) -> dict:
    """One job on 4 emulated stages in `chains` chains; its figures and outputs."""
    from layerbus.broker.broker import BrokerConfig
    from layerbus.broker.local_cluster import LocalStageOptions
    from layerbus.broker.scheduler import BatchingConfig
    from layerbus.jobs.chain_split import split_stages
    from layerbus.jobs.job_workload import job_workload
    from layerbus.jobs.leases import LeaseConfig
    from layerbus.cli.chains import chain_runs, run_chains
    from layerbus.jobs.local_run import run_job_locally, stage_log_dir
    from layerbus.models.model_info import load_tokenizer
    from layerbus.storage import JobStore, default_results_dir
    from layerbus.storage.results import read_results

    db = f"sqlite:///{home / f'jobs-{chains}.db'}"
    job_id = submit(corpus, model_dir, db)
    started = time.perf_counter()
    with JobStore.open(db) as store:
        config = BrokerConfig(str(model_dir), args.stages, partition="balanced",
                              batching=BatchingConfig(micro_batch_size=args.micro_batch_size,
                                                      max_context=args.max_context),
                              workload=job_workload(store, job_id, load_tokenizer(model_dir)))
        options = LocalStageOptions(threads_per_stage=1, log_dir=stage_log_dir(job_id),
                                    extra_args=("--emulate-speed", str(args.emulate_speed)))
        if chains == 1:
            status = run_job_locally(store, job_id, config, options, default_results_dir(), progress=False)
        else:
            runs = chain_runs(split_stages(args.stages, chains), db, job_id, config, options, default_results_dir(),
                              LeaseConfig(), stage_log_dir(job_id))
            status = run_chains(runs, progress=False)
        wall = time.perf_counter() - started
        assert status.status == "completed", f"{chains} chain(s): job {job_id} is {status.status}: {status.error}"
        workers = store.job_workers(job_id)
        events = [(e.kind, e.message) for e in store.job_events(job_id)]
    rows = read_results(Path(status.results_path)).to_pylist()
    return {"chains": chains, "job_id": job_id, "tok_s": status.tokens_per_s,
            "completion_tokens": status.completion_tokens,
            "job_s": status.completion_tokens / status.tokens_per_s, "wall_s_with_startup": wall,
            "placed": [message for kind, message in events if kind == "placed"],
            "workers": [{"chain": w.chain, "items_done": w.items_done, "tok_s": w.tokens_per_s} for w in workers],
            "broker_cpu": _broker_cpu(stage_log_dir(job_id)),
            "outputs": {row["custom_id"]: row["output"] for row in rows}}


def _broker_cpu(log_dir: Path) -> list[str]:
    """Each chain broker's CPU over the job, as its log's last line says (cli/chain_process.py)."""
    found = []
    for path in sorted(log_dir.glob("chain-*.log")):
        match = re.findall(r"broker process CPU .*", path.read_text())
        found += [f"{path.stem}: {line}" for line in match[-1:]]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--items", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--emulate-speed", type=float, default=0.4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_chains.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir

    model_dir = args.model or default_model_dir()
    home = Path(tempfile.mkdtemp(prefix="bench-chains-"))
    os.environ["LAYERBUS_HOME"] = str(home)  # results, logs and stores of this run only
    corpus = write_corpus(home / "stories.jsonl", args.items, args.max_new_tokens)
    one = run(1, args, model_dir, corpus, home)
    two = run(2, args, model_dir, corpus, home)
    same = one["outputs"] == two["outputs"]
    report = {"model": str(model_dir), "items": args.items, "max_new_tokens": args.max_new_tokens,
              "stages": args.stages, "emulate_speed": args.emulate_speed, "micro_batch_size": args.micro_batch_size,
              "partition": "balanced", "cpu_count": os.cpu_count(), "outputs_identical": same,
              "speedup": two["tok_s"] / one["tok_s"], "target": 1.6,
              "runs": [{k: v for k, v in row.items() if k != "outputs"} for row in (one, two)]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{args.items} story prompts, up to {args.max_new_tokens} new tokens each, greedy; {args.stages} stages at "
          f"--emulate-speed {args.emulate_speed}, one thread each; micro-batches of {args.micro_batch_size}; "
          f"{os.cpu_count()} cores")
    print("| shape | chains (stage spans) | generated tokens | job s | tok/s | start-up + job s | items per chain |")
    print("|---|---|---|---|---|---|---|")
    for row in (one, two):
        shape = f"{row['chains']} chain(s) of {args.stages // row['chains']}"
        spans = "; ".join(message.split(" (")[0] for message in row["placed"])
        per_chain = ", ".join(str(w["items_done"]) for w in row["workers"])
        print(f"| {shape} | {spans} | {row['completion_tokens']} | {row['job_s']:.1f} | {row['tok_s']:.1f} | "
              f"{row['wall_s_with_startup']:.1f} | {per_chain} |")
    print(f"| 2x2 / 1x4 | | | | {report['speedup']:.2f}x (target 1.6x) | | |")
    print(f"\noutputs identical: {same}")
    for line in two["broker_cpu"]:
        print(line)
    print(f"written to {args.out}")
    if not same:
        sys.exit("the two shapes gave different outputs")


if __name__ == "__main__":
    main()
