"""Several chains on one job: tokens/s of the planner's choice of chains against 1 chain of 4, side by side in
one run, on the same job, outputs checked equal. The shape run beside one chain of four is the planner's
choice: `layerbus plan --stages 4 --json` profiles the same four stages and says how many chains and
which stages in each (planner/chain_plan.py), with predicted tokens/s for its choice and for one chain
(at the corpus's own prompt tokens per new token, every stage given layers as in the runs); both
predictions are tabled beside what ran.
Chains are run as `layerbus run --chains K` deals them (consecutive stages); with alike stages the
planner's groups are consecutive too (recorded as groups_are_consecutive).

SmolLM2-135M, four local stages with one thread each at --emulate-speed F (each stage sleeps so that it uses
at most F of a core: four fit this machine's two cores) and --memory-budget 1.3GB each (the model fits on two of
them, not on one), dense work (bench/corpus.py's story prompts, whose
answers run to the token limit), greedy. The runs go through the code `layerbus run` uses: run_job_locally
for one chain, launch/chains.py for several (one broker process per chain). Each chain's broker plans its
chain as `layerbus run` does, every stage kept (so one chain of four uses all four), with the same
micro-batch size; the number of micro-batches in flight is each broker's own choice. Each chain's
broker's own prediction (its "placed" event) is tabled beside the `layerbus plan` one. tokens/s is the job's own figure, as
`layerbus status` shows it: generated tokens over the time from the job's start (its first claim, once every
chain is placed) to its end; start-up (imports, loading, profiling) is reported apart. The target is
>= 1.6x for the planner's choice against one chain of four, within 15% of its prediction.

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


def prompt_ratio(corpus: Path, model_dir: Path, max_new_tokens: int) -> float:
    """Prompt tokens (chat template applied) per new token of the corpus: the planner's workload mix."""
    from layerbus.models.model_info import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    # return_dict=False: transformers 5 returns a BatchEncoding by default, whose len() is its 2 keys
    lengths = [len(tokenizer.apply_chat_template(json.loads(line)["body"]["messages"], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
               for line in corpus.read_text().splitlines()]
    return sum(lengths) / (len(lengths) * max_new_tokens)


def planner_choice(args: argparse.Namespace, model_dir: Path, ratio: float) -> dict:
    """What `layerbus plan` chooses for the four emulated stages (profiled for real, as `run` would):
    the number of chains, the groups, and the predicted tokens/s of the choice and of one chain."""
    command = [str(Path(sys.executable).parent / "layerbus"), "plan", "--stages", str(args.stages), "--model",
               str(model_dir), "--threads-per-stage", "1", "--emulate-speed", *[str(args.emulate_speed)] * args.stages,
               "--memory-budget", *[args.memory_budget] * args.stages,
               "--micro-batch-size", str(args.micro_batch_size), "--max-context", str(args.max_context),
               "--prompt-ratio", f"{ratio:.3f}", "--keep-all", "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"layerbus plan failed: {done.stderr[-2000:]}")
    chains = json.loads(done.stdout)["chains"]
    return {"chains": chains["chosen"]["chains"], "groups": chains["chosen"]["groups"],
            "predicted_tok_s": chains["chosen"]["tokens_per_s"], "single_predicted_tok_s": chains["single"]["tokens_per_s"],
            "by_count": chains["by_count"]}


def run(chains: int, args: argparse.Namespace, model_dir: Path, corpus: Path, home: Path) -> dict:
    """One job on 4 emulated stages in `chains` chains; its figures and outputs."""
    from layerbus.broker.broker import BrokerConfig
    from layerbus.planner.placement import PlanOptions
    from layerbus.launch.local_cluster import LocalStageOptions
    from layerbus.planner.batching import BatchingConfig
    from layerbus.jobs.chain_split import split_stages
    from layerbus.jobs.job_workload import job_workload
    from layerbus.jobs.leases import LeaseConfig
    from layerbus.launch.chains import chain_runs, run_chains
    from layerbus.launch.local_run import run_job_locally, stage_log_dir
    from layerbus.models.model_info import load_tokenizer
    from layerbus.storage import JobStore, default_results_dir
    from layerbus.storage.results import read_results

    db = f"sqlite:///{home / f'jobs-{chains}.db'}"
    job_id = submit(corpus, model_dir, db)
    started = time.perf_counter()
    with JobStore.open(db) as store:
        # Planned as `layerbus run` plans, every stage kept (as `plan --keep-all` priced them): each chain's
        # broker then prices its own chain, and its "placed" event carries that prediction.
        config = BrokerConfig(str(model_dir), args.stages, partition="planned",
                              plan_options=PlanOptions(allow_drop=False),
                              # As `layerbus run --micro-batch-size M` asks: the number of micro-batches and
                              # the prefill budget left to the broker (BatchingConfig's own default pins 256
                              # tokens a step, and with it the count at one per stage plus one).
                              batching=BatchingConfig(micro_batch_size=args.micro_batch_size, max_step_tokens=0,
                                                      max_context=args.max_context),
                              workload=job_workload(store, job_id, load_tokenizer(model_dir)))
        options = LocalStageOptions(threads_per_stage=1, log_dir=stage_log_dir(job_id),
                                    extra_args=("--emulate-speed", str(args.emulate_speed),
                                                "--memory-budget", args.memory_budget))
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
    placed = [message for kind, message in events if kind == "placed"]
    # Each chain broker's own prediction for its chain ("... (planned; predicted 47.7 tok/s)"), summed
    brokers_predicted = sum(float(m) for message in placed for m in re.findall(r"predicted ([0-9.]+) tok/s", message))
    return {"chains": chains, "job_id": job_id, "tok_s": status.tokens_per_s, "brokers_predicted_tok_s": brokers_predicted,
            "completion_tokens": status.completion_tokens,
            "job_s": status.completion_tokens / status.tokens_per_s, "wall_s_with_startup": wall,
            "placed": placed,
            # Each chain broker's per-stage busy ms/step, predicted against measured, at its run's end
            "predicted_reports": [message for kind, message in events if kind == "predicted"],
            "workers": [{"chain": w.chain, "items_done": w.items_done, "tok_s": w.tokens_per_s} for w in workers],
            "broker_cpu": _broker_cpu(stage_log_dir(job_id)),
            "outputs": {row["custom_id"]: row["output"] for row in rows}}


def _broker_cpu(log_dir: Path) -> list[str]:
    """Each chain broker's CPU over the job, as its log's last line says (launch/chain_process.py)."""
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
    parser.add_argument("--memory-budget", default="1.3GB",
                        help="each stage's whole memory, its runtime included (the model fits on two "
                             "stages, not on one; at 1.3GB `layerbus plan` finds 1 and 2 chains feasible, not 3 or 4)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_chains.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir

    model_dir = args.model or default_model_dir()
    home = Path(tempfile.mkdtemp(prefix="bench-chains-"))
    os.environ["LAYERBUS_HOME"] = str(home)  # results, logs and stores of this run only
    corpus = write_corpus(home / "stories.jsonl", args.items, args.max_new_tokens)
    ratio = prompt_ratio(corpus, model_dir, args.max_new_tokens)
    choice = planner_choice(args, model_dir, ratio)
    print(f"planner: {choice['chains']} chain(s) {choice['groups']}, {choice['predicted_tok_s']:.1f} tok/s predicted "
          f"(one chain of {args.stages}: {choice['single_predicted_tok_s']:.1f})", flush=True)
    # `--chains K` deals consecutive stages; the planner's groups (in any order within a chain) may differ
    indices = [sorted(int(name.split("-")[1]) for name in group) for group in choice["groups"]]
    consecutive = all(group == list(range(group[0], group[0] + len(group))) for group in indices)
    # One chain of four, the planner's choice, and two chains of two (the pinned shape the target is
    # about) when the planner chose otherwise: each beside the planner's prediction for its shape.
    shapes = sorted({1, choice["chains"], 2})
    predicted = {row["chains"]: row["tokens_per_s"] for row in choice["by_count"]}
    rows = {}
    for chains in shapes:
        rows[chains] = run(chains, args, model_dir, corpus, home)
        rows[chains]["predicted_tok_s"] = predicted[chains]
        rows[chains]["measured_over_predicted"] = rows[chains]["tok_s"] / predicted[chains] - 1
        if rows[chains]["brokers_predicted_tok_s"]:
            rows[chains]["measured_over_brokers_predicted"] = (rows[chains]["tok_s"]
                                                               / rows[chains]["brokers_predicted_tok_s"] - 1)
        rows[chains]["planner_choice"] = chains == choice["chains"]
    one, two = rows[1], rows[choice["chains"]]
    same = all(row["outputs"] == one["outputs"] for row in rows.values())
    report = {"model": str(model_dir), "items": args.items, "max_new_tokens": args.max_new_tokens,
              "stages": args.stages, "emulate_speed": args.emulate_speed, "memory_budget": args.memory_budget,
              "micro_batch_size": args.micro_batch_size,
              "partition": "planned, every stage kept", "cpu_count": os.cpu_count(), "prompt_tokens_per_new_token": ratio,
              "planner": choice, "groups_are_consecutive": consecutive, "outputs_identical": same,
              "speedup": two["tok_s"] / one["tok_s"], "predicted_speedup": two["predicted_tok_s"] / one["predicted_tok_s"],
              "two_chains_speedup": rows[2]["tok_s"] / one["tok_s"],
              "target": 1.6, "runs": [{k: v for k, v in row.items() if k != "outputs"} for row in rows.values()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{args.items} story prompts, up to {args.max_new_tokens} new tokens each, greedy; {args.stages} stages at "
          f"--emulate-speed {args.emulate_speed} and --memory-budget {args.memory_budget}, one thread each; micro-batches of {args.micro_batch_size}; "
          f"{os.cpu_count()} cores")
    print("| shape | chains (stage spans) | generated tokens | job s | tok/s | predicted tok/s (plan; brokers) | "
          "measured vs predicted | start-up + job s | items per chain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows.values():
        shape = f"{row['chains']} chain(s) of {args.stages // row['chains']}" + (" (planner)" if row["planner_choice"] else "")
        spans = "; ".join(message.split(" (")[0] for message in row["placed"])
        per_chain = ", ".join(str(w["items_done"]) for w in row["workers"])
        print(f"| {shape} | {spans} | {row['completion_tokens']} | {row['job_s']:.1f} | {row['tok_s']:.1f} | "
              f"{row['predicted_tok_s']:.1f}; {row['brokers_predicted_tok_s']:.1f} | "
              f"{100 * row['measured_over_predicted']:+.0f}% | "
              f"{row['wall_s_with_startup']:.1f} | {per_chain} |")
    print(f"| planner's choice / 1x{args.stages} | | | | {report['speedup']:.2f}x (target 1.6x) | "
          f"{report['predicted_speedup']:.2f}x | | | |")
    print(f"| 2 chains / 1x{args.stages} | | | | {report['two_chains_speedup']:.2f}x | "
          f"{rows[2]['predicted_tok_s'] / one['predicted_tok_s']:.2f}x | | | |")
    print(f"\noutputs identical: {same}")
    for line in rows[2]["broker_cpu"]:
        print(line)
    for row in rows.values():
        for predicted in row["predicted_reports"]:
            print(f"\n{row['chains']} chain(s), predicted against measured:\n{predicted}")
    print(f"written to {args.out}")
    if not same:
        sys.exit("the two shapes gave different outputs")


if __name__ == "__main__":
    main()
