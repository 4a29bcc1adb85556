"""`layerbus run`: submit a job (or take an existing one) and run it on a broker plus N stage processes
started on this machine, with a progress bar; exit 0 iff the job completed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from layerbus.cli.errors import EXIT_FAILED, EXIT_OK, RunFailed, UsageError
from layerbus.cli.options import (
    AUTO_CHAINS,
    add_cluster_options,
    add_job_options,
    add_metrics,
    add_trace,
    add_weights,
    batching_from_args,
    chains_count,
    checked_stage_flag,
    command_parser,
    leases_from_args,
    link_probe_from_args,
    model_for_stages,
    non_negative_int,
    open_store,
    pipeline_from_args,
    positive_int,
    report_trace,
    results_dir,
    start_metrics,
    wire_from_args,
)
from layerbus.launch.signals import Interrupted, stop_on_signals
from layerbus.cli.status import job_report
from layerbus.storage.states import FINAL_JOB_STATES

if TYPE_CHECKING:
    from layerbus.broker.broker import BrokerConfig
    from layerbus.launch.local_cluster import LocalStageOptions
    from layerbus.broker.metrics_server import MetricsServer
    from layerbus.storage import JobStatus, JobStore


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "run", main, help="submit and run a job on local stage processes",
                        description="Submit INPUT as a job (or resume --job JOB) and run it on a broker "
                                    "in this process and N stage processes on this machine (with --chains "
                                    "K: K chains of them, each with a broker process of its own). Ctrl-C "
                                    "stops cleanly; `layerbus run --job JOB` resumes.") as parser:
        parser.add_argument("input", metavar="INPUT", nargs="?", help="as for `layerbus submit` (omit with --job)")
        parser.add_argument("--job", metavar="JOB", default=None, help="run (or resume) this queued or interrupted job")
        add_job_options(parser)
        parser.add_argument("--stages", metavar="N", type=positive_int, default=3, help="stage processes (default: 3)")
        parser.add_argument("--chains", metavar="K", type=chains_count, default=1,
                            help="pipelines working the job side by side: the N stages are dealt into K chains in "
                                 "order (N/K stages each, the first chains take the remainder), each driven by a "
                                 "broker process of its own; items are leased, so each is done once, and a chain that "
                                 "loses a stage re-plans or leaves its items to the others. Each chain's broker logs "
                                 "to chain-1.log, chain-2.log, ... beside the stage logs. 1 to N, or 'auto': the "
                                 "stages are profiled first and the planner chooses K and each chain's size, as "
                                 "`layerbus plan --stages N` shows (default: 1: one chain of all N stages)")
        parser.add_argument("--threads-per-stage", metavar="N", type=non_negative_int, default=0,
                            help="torch threads per stage (default: this machine's cores shared evenly)")
        add_cluster_options(parser)
        add_weights(parser)
        parser.add_argument("--memory-budget", metavar="SIZE", nargs="+", default=[],
                            help="memory budget of the local stages, each its whole resident memory, runtime included "
                                 "(300MB, 1.5GiB): one SIZE for every stage, or one per stage ('-' = free memory); "
                                 "with --chains, the i-th SIZE is stage-i's in whichever chain it lands (chain 1 holds "
                                 "stages 0 to N/K-1, and so on); with --weights auto the planner quantizes a stage's "
                                 "span only where full precision does not fit")
        add_trace(parser)
        add_metrics(parser)


def main(args: argparse.Namespace) -> int:
    if (args.input is None) == (args.job is None):
        raise UsageError("give INPUT (to submit a new job) or --job JOB (to run an existing one)"
                         + (", not both" if args.input else ""))
    check_chains(args)
    stage_budgets(args)  # a bad size is refused before anything is queued
    batching_from_args(args)  # so is a bad --speculate
    metrics = start_metrics(args)  # first: an address it cannot listen on is refused before anything is queued
    try:
        status, events, workers, job_id = _submit_and_run(args, metrics)
    finally:
        if metrics is not None:
            metrics.close()
    print(job_report(status, events, workers if len(workers) > 1 else ()))  # several brokers: who did what
    if status.status != "completed":
        print(f"layerbus: job {job_id} is {status.status}" + (f": {status.error}" if status.error else ""),
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _submit_and_run(args: argparse.Namespace, metrics: MetricsServer | None) -> tuple[JobStatus, list, list, str]:
    from layerbus.launch.stage_launcher import warm_up

    if getattr(args, "chains", 1) == 1:  # several chains start their own launchers, in processes of their own
        warm_up()  # the stages' imports go on while the input is read, checked and queued
    with open_store(args.db) as store:
        if args.job:
            if args.task or args.model:
                raise UsageError("--job runs the job with the settings it was submitted with: drop --task/--model")
            job_id = args.job
            model_dir = Path(store.job_settings(job_id).model)  # StoreError when there is no such job
            model_for_stages(model_dir, _longest_chain(args))
        else:
            from layerbus.cli.submit import submit_job

            # The stages are checked against the model before queueing: a job that cannot run is not queued.
            job_id = submit_job(store, args, check_model=lambda model: model_for_stages(model, _longest_chain(args)))
            model_dir = Path(store.job_settings(job_id).model)
        status = store.job_status(job_id)
        if status.status not in FINAL_JOB_STATES:  # a finished job needs no cluster
            status = run_locally(store, job_id, model_dir, args, metrics)
        return status, store.job_events(job_id), store.job_workers(job_id), job_id


def run_locally(store: JobStore, job_id: str, model_dir: Path, args: argparse.Namespace,
                metrics: MetricsServer | None = None) -> JobStatus:
    """Run a queued or interrupted job on a broker here and args.stages local stage processes; `metrics`
    (--metrics) serves the broker once it has placed the model, and the job."""
    from layerbus.broker.broker import BrokerConfig
    from layerbus.broker.control import ClusterError
    from layerbus.launch.local_cluster import LocalStageOptions
    from layerbus.launch.local_run import run_job_locally, stage_log_dir

    from layerbus.jobs.job_workload import job_workload
    from layerbus.models.model_info import load_tokenizer

    log_dir = stage_log_dir(job_id)
    trace = getattr(args, "trace", None)  # `eval run` shares this function and has no --trace
    # The plan prices this job's own prompts and output budgets (an eval's: the positions it scores), and
    # sizes the batches, the step budget and the KV caches for it.
    workload = job_workload(store, job_id, load_tokenizer(model_dir))
    batching = batching_from_args(args)
    config = BrokerConfig(str(model_dir), args.stages, partition=args.partition,
                          batching=batching, pipeline=pipeline_from_args(args),
                          workload=workload, **wire_from_args(args), weights=args.weights, trace=trace,
                          link_probe=link_probe_from_args(args))
    options = LocalStageOptions(threads_per_stage=args.threads_per_stage, log_dir=log_dir,
                                stage_args=stage_budgets(args))
    chains = _chains(job_id, args, config, options, log_dir)
    if len(chains) > 1:
        return _run_chains(job_id, chains, config, options, args, log_dir)
    print(f"layerbus: running {job_id} on {args.stages} local stage(s); stage logs in {log_dir}", file=sys.stderr)
    if metrics is not None:
        metrics.watch_job(store, job_id)
    try:
        with stop_on_signals():
            return run_job_locally(store, job_id, config, options, results_dir(), leases=leases_from_args(args),
                                   on_started=metrics.attach if metrics is not None else None)
    except ClusterError as error:
        raise RunFailed(f"{error}\nstage logs: {log_dir}; the job keeps its finished items: "
                        f"`layerbus run --job {job_id}` resumes it") from None
    except Interrupted as interrupted:
        print(f"layerbus: stopped by {interrupted}; items in flight were requeued; "
              f"`layerbus run --job {job_id}` resumes", file=sys.stderr)
        raise
    finally:
        report_trace(trace)  # written by the broker as it closes, whatever the run's end


def check_chains(args: argparse.Namespace) -> None:
    """--chains K against --stages N, and the options that serve one broker only."""
    from layerbus.jobs.chain_split import chains_error

    if args.chains == AUTO_CHAINS:
        if args.partition != "planned":
            raise UsageError(f"--chains auto chooses from the stages' profiles, which --partition {args.partition} "
                             "does not use: drop --partition, or pin --chains K")
        if args.metrics is not None or args.trace is not None:
            raise UsageError("--metrics and --trace serve one broker, and --chains auto may choose several: pin "
                             "--chains 1 to use them")
        return
    error = chains_error(args.stages, args.chains)
    if error is not None:
        raise UsageError(error)
    if args.chains > 1 and args.metrics is not None:
        raise UsageError(f"--metrics serves one broker; --chains {args.chains} runs {args.chains}: drop --metrics, or "
                         "use --chains 1")
    if args.chains > 1 and args.trace is not None:
        raise UsageError(f"--trace records one broker's timeline; --chains {args.chains} runs {args.chains}: drop "
                         "--trace, or use --chains 1")


def _longest_chain(args: argparse.Namespace) -> int:
    """Stages in the longest chain: each chain must find a layer for every one of its stages."""
    from layerbus.jobs.chain_split import split_stages

    chains = getattr(args, "chains", 1)
    return max(chain.count for chain in split_stages(args.stages, chains if chains != AUTO_CHAINS else 1))


def _chains(job_id: str, args: argparse.Namespace, config: BrokerConfig, options: LocalStageOptions,
            log_dir: Path) -> list:
    """The chains the run forms (jobs.chain_split.ChainStages each): --chains K dealt in order, or under
    --chains auto the planner's choice over the profiled stages. One chain: the plain run."""
    from layerbus.jobs.chain_split import split_stages

    chains = getattr(args, "chains", 1)  # `eval run` shares run_locally and has no --chains
    if chains != AUTO_CHAINS:
        return split_stages(args.stages, chains)
    from layerbus.broker.control import ClusterError
    from layerbus.planner.placement import PlacementError
    from layerbus.cli.chain_choice import chains_of, choose_local_chains, describe

    kept = f"the job keeps what it has done: `layerbus run --job {job_id}` runs it"
    try:
        with stop_on_signals():
            plan = choose_local_chains(config, options)
    except Interrupted as interrupted:
        print(f"layerbus: stopped by {interrupted} while choosing the chains, before any item was claimed: `layerbus run --job "
              f"{job_id}` runs it", file=sys.stderr)
        raise
    except ClusterError as error:
        raise RunFailed(f"--chains auto could not profile the stages: {error}\nstage logs: {log_dir}; {kept}") from None
    except PlacementError as error:
        raise RunFailed(f"--chains auto: {error}\n{kept}") from None
    print(describe(plan), file=sys.stderr)
    return chains_of(plan)


def _run_chains(job_id: str, chains: list, config: BrokerConfig, options: LocalStageOptions,
                args: argparse.Namespace, log_dir: Path) -> JobStatus:
    """run_locally with several chains (jobs.chain_split.ChainStages each): a chain process each, a broker
    over its share of the stages, each opening the store itself from --db."""
    from layerbus.launch.chains import chain_runs, run_chains
    from layerbus.storage import default_db_url

    runs = chain_runs(chains, args.db or default_db_url(), job_id, config, options, results_dir(),
                      leases_from_args(args), log_dir)
    shares = ", ".join(f"{chain.label}: stage-{chain.first}..stage-{chain.first + chain.count - 1}"
                       if chain.count > 1 else f"{chain.label}: stage-{chain.first}" for chain in chains)
    print(f"layerbus: running {job_id} on {args.stages} local stage(s) in {len(chains)} chains ({shares}); stage "
          f"logs and each chain's broker log (chain-I.log) in {log_dir}", file=sys.stderr)
    try:
        with stop_on_signals():
            status = run_chains(runs)
    except Interrupted as interrupted:
        print(f"layerbus: stopped by {interrupted}; every chain requeued its items in flight; "
              f"`layerbus run --job {job_id}` resumes", file=sys.stderr)
        raise
    if status.status not in FINAL_JOB_STATES:  # every chain broke or left: the job waits, its items kept
        with open_store(args.db) as store:
            why = [event.message for event in store.job_events(job_id) if event.kind == "chain_failed"]
        raise RunFailed("\n".join([f"every chain stopped before {job_id} ended:", *why,
                                    f"each chain's log: {log_dir}/chain-I.log; the job keeps its finished items: "
                                    f"`layerbus run --job {job_id}` resumes it"]))
    return status


def stage_budgets(args: argparse.Namespace) -> tuple[tuple[str, ...], ...]:
    """Each local stage's `--memory-budget SIZE` arguments from `run --memory-budget` (one size for all,
    or one per stage; '-' leaves a stage on its free memory)."""
    sizes = list(getattr(args, "memory_budget", None) or [])  # `eval run` shares run_locally and has none
    if not sizes:
        return ()
    if len(sizes) not in (1, args.stages):
        raise UsageError(f"--memory-budget takes one SIZE for every stage or one per stage (--stages {args.stages}), "
                         f"got {len(sizes)}")
    sizes = sizes * args.stages if len(sizes) == 1 else sizes
    return tuple(() if size == "-" else checked_stage_flag("--memory-budget", size) for size in sizes)
