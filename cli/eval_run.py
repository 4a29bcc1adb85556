"""`layerbus eval run`: queue a suite's (or the given tasks') documents as a job, run it on local stages
as `layerbus run` does, then print the metrics with their standard errors and where the samples and
results JSON are. `--job JOB` resumes an interrupted run, or finalizes one a cluster ran."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerbus.cli.errors import EXIT_FAILED, EXIT_OK, UsageError
from layerbus.cli.options import (
    add_cluster_options,
    add_db,
    add_model,
    add_weights,
    command_parser,
    model_for_stages,
    non_negative_int,
    open_store,
    positive_int,
    resolve_model,
    results_dir,
    seed,
)
from layerbus.storage.states import FINAL_JOB_STATES

# `--suite nightly` finds the suite layerbus ships.
BUNDLED_SUITES = Path(__file__).resolve().parent.parent / "examples" / "evals"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "run", main, help="score tasks or a suite on local stages",
                        description="Queue every document of the tasks (task files, folders of .txt files, "
                                    "lm-eval task YAML) or of --suite as one job, run it on a broker here "
                                    "and N local stage processes, and print each task's metrics with "
                                    "standard errors. The run is resumable with --job and its metrics are "
                                    "stored for `layerbus eval compare` and `layerbus eval history`.") as parser:
        parser.add_argument("tasks", metavar="TASK", nargs="*", help="task file (.jsonl, .parquet), folder of .txt "
                            "files (bits per byte), or lm-eval task YAML")
        parser.add_argument("--suite", metavar="NAME|FILE", default=None,
                            help=f"a suite file (TOML), or the name of a bundled one ({', '.join(bundled_suites())})")
        parser.add_argument("--job", metavar="JOB", default=None, help="resume or finalize this eval run")
        add_model(parser, "Hugging Face model directory (default: SmolLM2-135M-Instruct, prepared on first use)")
        parser.add_argument("--stages", metavar="N", type=positive_int, default=1, help="stage processes (default: 1)")
        parser.add_argument("--threads-per-stage", metavar="N", type=non_negative_int, default=0,
                            help="torch threads per stage (default: this machine's cores shared evenly)")
        parser.add_argument("--limit", metavar="N", type=positive_int, default=None,
                            help="score the first N documents of each task (a smoke run; results say so)")
        parser.add_argument("--num-fewshot", metavar="K", type=non_negative_int, default=None,
                            help="few-shot examples for task YAML (default: the suite's, else 0)")
        parser.add_argument("--seed", metavar="S", type=seed, default=None,
                            help="few-shot sampler seed (default: the suite's, else 1234 as lm-eval)")
        parser.add_argument("--queue", action="store_true",
                            help="only queue the run and print its job id, for a cluster started with run_cluster.sh "
                                 "to score; `layerbus eval run --job JOB` then reports it")
        parser.add_argument("--json", action="store_true", help="print the outcome as JSON")
        add_db(parser)
        add_cluster_options(parser)
        add_weights(parser)


def bundled_suites() -> list[str]:
    return sorted(p.stem for p in BUNDLED_SUITES.glob("*.toml"))


def suite_path(given: str) -> Path:
    path = Path(given).expanduser()
    if path.is_file():
        return path
    bundled = BUNDLED_SUITES / f"{given}.toml"
    if bundled.is_file():
        return bundled
    raise UsageError(f"--suite {given}: no such suite file, and no bundled suite of that name (bundled: "
                     f"{', '.join(bundled_suites()) or 'none'}); give the path of a suite TOML")


def main(args: argparse.Namespace) -> int:
    from layerbus.evals.eval_run import EvalOptions

    if args.job and (args.tasks or args.suite):
        raise UsageError("--job runs the eval as it was queued: drop the tasks and --suite")
    if not args.job and bool(args.tasks) == bool(args.suite):
        raise UsageError("give TASK files or --suite NAME" + (", not both" if args.tasks else
                                                               " (e.g. --suite nightly, the bundled suite)"))
    options = EvalOptions(tuple(args.tasks), suite_path(args.suite) if args.suite else None, args.limit,
                          args.num_fewshot, args.seed)
    if args.queue and args.job:
        raise UsageError(f"--queue queues a new run; job {args.job} is queued already: drop --queue")
    with open_store(args.db) as store:
        job_id, model_dir = _queued(store, args, options) if not args.job else _existing(store, args)
        if args.queue:
            print(job_id)
            return EXIT_OK
        status = store.job_status(job_id)
        if status.status not in FINAL_JOB_STATES:
            from layerbus.cli.run import run_locally

            status = run_locally(store, job_id, model_dir, args)
        if status.status != "completed":
            print(f"layerbus: eval run {job_id} is {status.status}" + (f": {status.error}" if status.error else "")
                  + f"; `layerbus eval run --job {job_id}` resumes it", file=sys.stderr)
            return EXIT_FAILED
        from layerbus.evals.eval_run import finalize_eval

        outcome = finalize_eval(store, job_id, results_dir() / "evals",
                                {"stages": args.stages, "wire": args.wire, "partition": args.partition})
        counts = store.job_status(job_id)
    print(json.dumps(outcome_json(outcome), indent=2) if args.json else metrics_table(outcome))
    if counts.failed:
        print(f"layerbus: {counts.failed} document(s) failed; their errors are in {outcome.samples_path}",
              file=sys.stderr)
    return EXIT_OK


def _queued(store, args, options) -> tuple[str, Path]:
    from layerbus.evals.encoding import Encoder
    from layerbus.evals.eval_run import queue_eval, select_tasks
    from layerbus.models.fingerprint import model_fingerprint
    from layerbus.models.model_info import load_tokenizer

    from layerbus.evals.suites import SuiteError

    try:
        suite, tasks = select_tasks(options)  # before the model: a bad task file is reported at once
    except SuiteError as error:
        count = len(error.problems)
        raise UsageError(f"{count} problem{'s' if count != 1 else ''} in the tasks; nothing was queued:\n{error}") \
            from None
    if not args.queue:
        from layerbus.launch.stage_launcher import warm_up

        warm_up()  # the stages' imports go on while the model is read and the tasks tokenized and queued
    model_dir = resolve_model(args.model)
    info = model_for_stages(model_dir, args.stages)
    # lm-eval's max_length: what the broker's context allows (--max-context, capped by the model's limit).
    max_length = min(args.max_context, info.max_positions)
    fingerprint = {"model": model_fingerprint(model_dir), "dtype": "float32", "weights": args.weights, "wire": args.wire,
                   "layerbus": _version(), "max_length": max_length, "limit": options.limit,
                   "num_fewshot": [t.num_fewshot for t in tasks], "seed": suite.seed}
    tokenizer = load_tokenizer(model_dir)
    # Long texts are windowed to max_length here (rolling log-likelihood), never fed whole: the tokenizer's
    # "sequence longer than the maximum" warning would only mislead.
    tokenizer.model_max_length = max(tokenizer.model_max_length, 1 << 40)
    job_id = queue_eval(store, model_dir, suite, tasks, Encoder(tokenizer), max_length, fingerprint)
    total = store.job_status(job_id).total
    print(f"layerbus: queued eval run {job_id}: {len(tasks)} task(s), {total} document(s)", file=sys.stderr)
    return job_id, model_dir


def _existing(store, args) -> tuple[str, Path]:
    if args.model:
        raise UsageError("--job runs the eval with the model it was queued with: drop --model")
    run = store.eval_run(args.job)  # StoreError naming the way out when it is not an eval run
    model_dir = Path(run.model)
    model_for_stages(model_dir, args.stages)
    return args.job, model_dir


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("layerbus")
    except PackageNotFoundError:
        return "unknown"


def outcome_json(outcome) -> dict:
    return {"job_id": outcome.job_id, "samples": str(outcome.samples_path), "results": str(outcome.results_path),
            "metrics": [{"task": m.task, "metric": m.metric, "filter": m.filter, "value": m.value,
                         "stderr": m.stderr, "n": m.n} for m in outcome.metrics]}


def metrics_table(outcome) -> str:
    rows = [("task", "metric", "value", "± stderr", "n")]
    for m in outcome.metrics:
        rows.append((m.task, m.metric if m.filter == "none" else f"{m.metric} ({m.filter})", f"{m.value:.4f}",
                     "N/A" if m.stderr is None else f"{m.stderr:.4f}", str(m.n)))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines += ["", f"eval run {outcome.job_id}", f"samples: {outcome.samples_path}", f"results: {outcome.results_path}"]
    return "\n".join(lines)
