"""One chain of `layerbus run --chains K`, in a child process of its own: a Broker over a LocalCluster of
this chain's stages, running the job through run_job like any other broker working it (leases, exactly
once, one finalizer). Every event it records and its worker record name the chain ("chain 2: ..."), so
`layerbus status JOB` tells the chains apart.

The child is started with multiprocessing's "spawn" (a fresh interpreter, nothing inherited but what
ChainRun carries): the parent holds a tokenizer's threads and a store's connections, which fork would
copy half-alive.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerbus.broker.broker import Broker, BrokerConfig
from layerbus.launch.local_cluster import LocalStageOptions
from layerbus.jobs.chain_events import ChainEvents
from layerbus.jobs.chain_split import ChainStages
from layerbus.jobs.leases import LeaseConfig

log = logging.getLogger("layerbus.chains")

# Exit codes of a chain process, read by launch/chains.py.
CHAIN_COMPLETED = 0  # the job completed (finalized here or by another chain)
CHAIN_NOT_COMPLETED = 1  # the job ended otherwise (failed, cancelled), or this chain left it to the others
CHAIN_BROKEN = 3  # this chain's broker stopped on an error (its stages broke, or cannot hold the model)


@dataclass(frozen=True)
class ChainRun:
    """What one chain's process needs, picklable (it crosses to a spawned child on this machine only)."""

    chain: ChainStages  # which of the run's stages are this chain's
    db_url: str  # the job store (each process opens its own connection)
    job_id: str
    config: BrokerConfig  # this chain's broker: num_stages = chain.count
    options: LocalStageOptions  # this chain's stages: first_stage = chain.first, their own budgets
    results_dir: Path
    leases: LeaseConfig
    log_path: Path  # this chain's broker log (its stages log to their own stage-i.log beside it)
    start_timeout_s: float  # wait at most this long, once placed, for the other chains to be placed


def chain_main(run: ChainRun, placed: Any, go: Any) -> None:
    """The child's body: `placed` (a queue) is told this chain's index once its stages are placed; the
    job starts once `go` (an event) is set, so every chain claims from the same moment. Exits with one
    of the CHAIN_* codes, or 128 + the signal that stopped it."""
    from layerbus.broker.control import ClusterError
    from layerbus.planner.plan_values import PlacementError
    from layerbus.launch.process_life import die_with_parent
    from layerbus.launch.signals import Interrupted, stop_on_signals
    from layerbus.launch.local_run import run_job_locally
    from layerbus.storage import JobStore

    die_with_parent()  # a killed `layerbus run` leaves no chain behind
    if os.getppid() == 1:
        sys.exit(CHAIN_BROKEN)  # the parent died before the line above
    _log_to(run.log_path)
    label = run.chain.label
    at_go: list[tuple[float, float]] = []  # (CPU s, wall s) when the job started: the job's own share follows
    with JobStore.open(run.db_url) as store:
        events = ChainEvents(store, label)
        try:
            with stop_on_signals():
                status = run_job_locally(events, run.job_id, run.config, run.options, run.results_dir,
                                         progress=False, leases=run.leases,
                                         on_started=lambda broker: at_go.append(
                                             _start_together(broker, run, placed, go)))
        except Interrupted as interrupted:
            log.warning("%s stopped by %s; items in flight were requeued", label, interrupted)
            sys.exit(interrupted.exit_code)
        except Exception as error:  # noqa: BLE001 (this chain ends; the job is the other chains' to finish)
            # A broken cluster or a model its stages cannot hold is explained by its message; anything else
            # may be a bug, and its traceback goes to the chain's log.
            log.error("%s broke: %s", label, error, exc_info=not isinstance(error, (ClusterError, PlacementError)))
            events.add_job_event(run.job_id, "chain_failed", f"its broker stopped: {error}")
            sys.exit(CHAIN_BROKEN)
    log.info("%s done: job %s is %s; %s", label, run.job_id, status.status, _cpu_use(*at_go[0]))
    sys.exit(CHAIN_COMPLETED if status.status == "completed" else CHAIN_NOT_COMPLETED)


def _start_together(broker: Broker, run: ChainRun, placed: Any, go: Any) -> tuple[float, float]:
    """Once this chain is placed: say so, then keep its stages alive until every chain is (or has given up),
    so no chain has the job to itself while the others load. This process's (CPU s, wall s) then."""
    placed.put(run.chain.index)
    deadline = time.monotonic() + run.start_timeout_s
    while not go.is_set() and time.monotonic() < deadline:
        broker.keep_alive(0.2)
    return _cpu_s(), time.monotonic()


def _cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_use(cpu_at_go: float, wall_at_go: float) -> str:
    """This broker process's CPU time against its wall time since the job started: what one chain's broker
    would take from the others' under one interpreter lock, were the chains threads (launch/chains.py)."""
    cpu, wall = _cpu_s() - cpu_at_go, time.monotonic() - wall_at_go
    return f"broker process CPU {cpu:.1f} s over {wall:.1f} s wall ({cpu / max(wall, 1e-9):.2f} of a core)"


def _log_to(path: Path) -> None:
    """This process's stderr (and so its log records) into the chain's log file; layerbus's INFO included,
    as the chain's log is the only place its broker speaks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "ab", buffering=0)
    os.dup2(handle.fileno(), 2)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("layerbus").setLevel(logging.INFO)
