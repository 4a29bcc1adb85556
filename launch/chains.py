"""`layerbus run --stages N --chains K`: K chains of this machine's stages working one job side by side,
each a child process with its own Broker and LocalCluster (launch/chain_process.py). They share the job
as several `layerbus broker` processes do, through the store's item leases (jobs/leases.py): each item
is done once, exactly one chain finalizes, and a chain that loses a stage re-plans (or leaves the job
to the others) while the others keep going.

Why child processes rather than one Broker per thread in this process: a broker's scheduling, wire
encoding, detokenizing and store writes are Python, run under the GIL. Measured (bench/bench_chains.py,
4 SmolLM2 stages at --emulate-speed 0.4 on 2 cores, 2 chains of 2): each chain's broker process used
6.2 s of CPU over the 290 s job (0.02 of a core), about 2.8 ms per generated token. At that pace threads
would have cost nothing measurable; but the cost grows with the stages' speed (at that cost per token
a chain at 360 tok/s needs a whole core for its broker), and threads would put every chain's steps
and the lease-renewing threads behind one interpreter lock. Processes share nothing but the store,
and give each chain what a broker process already has and is tested for (tests/cluster/test_brokers_one_job.py):
its own worker name in the store (host:pid:token), its own signal handling, a log of its own, and a
fault that takes one chain down without the others. The price: each chain's process imports torch once (a few seconds of
start-up, while the stages load anyway).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalStageOptions
from layerbus.launch.chain_process import ChainRun, chain_main
from layerbus.launch.process_life import ChildProcess, stop_children
from layerbus.jobs.chain_split import ChainStages
from layerbus.jobs.leases import LeaseConfig
from layerbus.storage import JobStatus, JobStore

log = logging.getLogger("layerbus.chains")

STOP_WAIT_S = 60.0  # after a signal: how long each chain may take to requeue and stop its stages


def chain_runs(chains: list[ChainStages], db_url: str, job_id: str, config: BrokerConfig,
               options: LocalStageOptions, results_dir: Path, leases: LeaseConfig, log_dir: Path) -> list[ChainRun]:
    """Each chain's share of the run's broker config and stage options. options.stage_args holds one
    entry per stage overall (or none): stage i keeps its own entry (its --memory-budget) in any chain.
    Threads per stage are shared over all N stages of the run, not over one chain's."""
    total = sum(chain.count for chain in chains)
    threads = options.threads_per_stage or max(1, (os.cpu_count() or 1) // total)
    runs = []
    for chain in chains:
        stage_args = options.stage_args[chain.first:chain.first + chain.count] if options.stage_args else ()
        runs.append(ChainRun(
            chain=chain, db_url=db_url, job_id=job_id,
            config=replace(config, num_stages=chain.count,
                           workload=config.workload.share(chain.index, len(chains)) if config.workload else None),
            options=replace(options, first_stage=chain.first, stage_args=stage_args, threads_per_stage=threads),
            results_dir=results_dir, leases=replace(leases, peers=max(leases.peers, len(chains))),
            log_path=log_dir / f"chain-{chain.index + 1}.log",
            start_timeout_s=config.register_timeout_s))
    return runs


def run_chains(runs: list[ChainRun], progress: bool = True) -> JobStatus:
    """Start one process per chain, start them on the job together once all are placed, wait for all to
    end; the job's status. A signal here (KeyboardInterrupt) is passed to every chain, which requeues
    its items in flight and stops its stages, as one broker does; then it propagates."""
    from tqdm import tqdm

    context = multiprocessing.get_context("spawn")
    placed, go = context.Queue(), context.Event()
    processes = [context.Process(target=chain_main, args=(run, placed, go), name=run.chain.label, daemon=False)
                 for run in runs]
    job_id = runs[0].job_id
    try:
        for process in processes:
            process.start()
        with JobStore.open(runs[0].db_url) as store, \
                tqdm(desc=job_id, unit="item", file=sys.stderr, disable=None if progress else True,
                     dynamic_ncols=True) as bar:
            _watch(processes, placed, go, store, job_id, bar)
            _report_chain_ends(runs, processes)
            return store.job_status(job_id)
    except KeyboardInterrupt as interrupt:
        _stop(processes, getattr(interrupt, "signum", signal.SIGINT))
        raise
    finally:
        _stop(processes, signal.SIGTERM)  # nothing left running, whatever ended this
        placed.close()


def _watch(processes, placed, go, store: JobStore, job_id: str, bar) -> None:
    """Until every chain process has ended: set `go` once each is placed or gone; update the progress bar."""
    ready: set[int] = set()
    while any(process.is_alive() for process in processes):
        wait([process.sentinel for process in processes if process.is_alive()], timeout=0.5)
        try:
            while True:
                ready.add(placed.get_nowait())
        except queue.Empty:
            pass
        if not go.is_set() and all(i in ready or not p.is_alive() for i, p in enumerate(processes)):
            go.set()
        status = store.job_status(job_id)
        bar.total = status.total
        bar.n = status.completed + status.failed + status.cancelled
        bar.refresh()


def _report_chain_ends(runs: list[ChainRun], processes) -> None:
    """A chain that ended otherwise than with the job is named on stderr, with its log."""
    from layerbus.launch.chain_process import CHAIN_COMPLETED

    for run, process in zip(runs, processes):
        if process.exitcode != CHAIN_COMPLETED:
            print(f"layerbus: {run.chain.label} (stages {run.chain.first} to {run.chain.first + run.chain.count - 1}) "
                  f"ended with exit code {process.exitcode}; its broker's log: {run.log_path}", file=sys.stderr)


def _stop(processes, signum: int) -> None:
    """Pass `signum` to every chain still running, give them STOP_WAIT_S to stop, then kill what is left."""
    stop_children([ChildProcess(process) for process in processes], signum, STOP_WAIT_S)
