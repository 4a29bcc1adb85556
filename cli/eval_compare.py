"""`layerbus eval compare`: two finished eval runs, document by document (evals/compare_runs.py), with a
verdict per metric and the documents that flipped. Read-only; no torch, no transformers (pyarrow reads the
samples files). `--fail-on-regression` makes it a CI gate: exit 3 when a metric is significantly worse."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from layerbus.cli.errors import EXIT_OK, EXIT_REGRESSION, UsageError
from layerbus.cli.options import add_db, command_parser, non_negative_float, open_store, positive_int

if TYPE_CHECKING:
    from layerbus.storage import EvalRun, JobStore

DEFAULT_BOOTSTRAP_ITERS = 10_000


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "compare", main, help="compare two eval runs document by document",
                        description="Compare the candidate run CAND with the base run BASE on the documents both "
                                    "scored: per task and metric the two values, the difference with its paired 95% "
                                    "interval, a p-value (McNemar for 0/1 metrics, paired bootstrap for perplexity "
                                    "and bits per byte), Holm's correction across the suite, a verdict, and the "
                                    "documents whose answer flipped. CAND defaults to the latest finished run (of "
                                    "--suite, or of BASE's suite); BASE to the run of CAND's suite before it.",
                        epilog="Exit codes: 0 compared (whatever the verdicts, unless "
                               "--fail-on-regression), 2 the runs cannot be compared as given (the message "
                               "says why), 3 a metric is significantly worse and --fail-on-regression was "
                               "given.") as parser:
        parser.add_argument("base", metavar="BASE", nargs="?", help="base run (job id; default: CAND's previous run)")
        parser.add_argument("cand", metavar="CAND", nargs="?", help="candidate run (job id; default: the latest)")
        parser.add_argument("--suite", metavar="NAME", default=None,
                            help="take the runs from this suite (e.g. nightly); without it, the latest run of any "
                                 "suite")
        parser.add_argument("--json", action="store_true", help="print the comparison as JSON, every flipped document")
        parser.add_argument("--fail-on-regression", action="store_true",
                            help="exit 3 when any metric is significantly worse after Holm's correction")
        parser.add_argument("--min-effect", metavar="X", type=non_negative_float, default=0.0,
                            help="a significant difference smaller than X (in the metric's units: 0.01 is one point of "
                                 "acc) is not called better or worse (default: 0)")
        parser.add_argument("--bootstrap-iters", metavar="N", type=positive_int, default=DEFAULT_BOOTSTRAP_ITERS,
                            help=f"paired bootstrap resamples for corpus metrics (default: {DEFAULT_BOOTSTRAP_ITERS})")
        add_db(parser)


def main(args: argparse.Namespace) -> int:
    from layerbus.cli.compare_report import comparison_json, comparison_text
    from layerbus.evals.compare_runs import CompareOptions, MetricKey, compare_runs
    from layerbus.evals.fingerprint_diff import fingerprint_changes, summary
    from layerbus.evals.run_pairs import NotComparableError, check_comparable

    with open_store(args.db) as store:
        cand = _candidate(store, args)
        base = _base(store, args, cand)
        base_metrics = [MetricKey(m.task, m.metric, m.filter) for m in store.eval_metrics(base.job_id)]
        cand_metrics = [MetricKey(m.task, m.metric, m.filter) for m in store.eval_metrics(cand.job_id)]
    base_rows, cand_rows = _samples(base), _samples(cand)
    changes = fingerprint_changes(base.fingerprint_json, cand.fingerprint_json)
    try:
        check_comparable(base_rows, cand_rows, base.job_id, cand.job_id)
    except NotComparableError as error:
        # What changed in the fingerprint usually says why the prompts differ (few-shot, tokenizer, --limit).
        differ = f" Their fingerprints differ in: {summary(changes)}." if changes else ""
        raise UsageError(f"{error}.{differ}") from None
    comparison = compare_runs(base_rows, cand_rows, base_metrics, cand_metrics,
                              CompareOptions(min_effect=args.min_effect, bootstrap_iters=args.bootstrap_iters))
    if args.json:
        print(json.dumps(comparison_json(base, cand, changes, comparison), indent=2, allow_nan=False))
    else:
        print(comparison_text(base, cand, changes, comparison, args.fail_on_regression))
    return EXIT_REGRESSION if args.fail_on_regression and comparison.regressions else EXIT_OK


def _candidate(store: JobStore, args: argparse.Namespace) -> EvalRun:
    if args.cand is not None:
        return _finished(store, args.cand, args.suite)
    # One job id given: it is BASE, and the candidate is the latest run of its suite unless --suite says otherwise.
    suite = args.suite if args.suite is not None or args.base is None else store.eval_run(args.base).suite
    latest = store.eval_runs(suite, limit=1)
    if not latest:
        of = "" if suite is None else f" of suite {suite!r}" if suite else " of ad-hoc tasks"
        run = f"--suite {suite}" if suite else "--suite nightly"
        raise UsageError(f"no finished eval run{of} in {store.url}: run `layerbus eval run {run}` first, or name "
                         "BASE and CAND (job ids)")
    if latest[0].job_id == args.base:  # comparing the latest run with itself would say "no change", uselessly
        raise UsageError(f"BASE {args.base} is itself the latest run{'' if suite is None else f' of suite {suite!r}'}: "
                         "name an earlier BASE, or give no job id to compare the latest run with the one before it")
    return latest[0]


def _base(store: JobStore, args: argparse.Namespace, cand: EvalRun) -> EvalRun:
    if args.base is not None:
        return _finished(store, args.base, args.suite)
    previous = store.previous_eval_run(cand.suite, cand.job_id)
    if previous is None:
        if cand.suite:
            raise UsageError(f"no earlier run of suite {cand.suite!r} before {cand.job_id}: run `layerbus eval run "
                             f"--suite {cand.suite}` again tomorrow, or name BASE")
        raise UsageError(f"no earlier ad-hoc eval run before {cand.job_id}: name BASE (a job id)")
    return previous


def _finished(store: JobStore, job_id: str, suite: str | None) -> EvalRun:
    run = store.eval_run(job_id)  # StoreError naming the way out when the job is no eval run
    if suite is not None and run.suite != suite:
        raise UsageError(f"{job_id} is a run of suite {run.suite!r}, not of --suite {suite}: drop --suite, or name "
                         f"a run of {suite}")
    if run.finished_at is None or run.samples_path is None:
        raise UsageError(f"eval run {job_id} has not finished (no samples file yet): `layerbus eval run --job "
                         f"{job_id}` finishes it")
    return run


def _samples(run: EvalRun) -> list[dict]:
    from pathlib import Path

    from layerbus.evals.doc_results import read_samples

    if not Path(run.samples_path).is_file():
        raise UsageError(f"the samples file of eval run {run.job_id} is missing: {run.samples_path}; "
                         f"`layerbus eval run --job {run.job_id}` writes it again")
    try:
        return read_samples(run.samples_path)
    except ValueError as error:  # another file in its place, or one from an older layerbus
        raise UsageError(f"eval run {run.job_id}: {error}; `layerbus eval run --job {run.job_id}` writes it again") \
            from None
