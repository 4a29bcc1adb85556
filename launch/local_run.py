"""Run one job on a broker in this process and N stage processes on this machine, from queued (or
interrupted) to its end: what `layerbus run` and the lm-evaluation-harness adapter share.

Not CLI code on purpose: the adapter runs inside lm-eval's process, where argparse namespaces, exit
codes and the CLI's signal handling have no place. The caller chooses how to report a broken cluster
(ClusterError) or an interrupt (KeyboardInterrupt: run_job requeues the items in flight and leaves
the job in_progress, so a later run resumes it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from layerbus.broker.broker import Broker, BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.jobs.leases import LeaseConfig
from layerbus.jobs.runner import run_job
from layerbus.models.home import layerbus_home
from layerbus.storage import JobStatus, JobStore
from layerbus.storage.run_info import write_run_info


def stage_log_dir(job_id: str) -> Path:
    """Where the stages of a local run of `job_id` write their logs (one file per stage)."""
    return layerbus_home() / "logs" / job_id


def run_job_locally(store: JobStore, job_id: str, config: BrokerConfig, options: LocalStageOptions,
                    results_dir: Path, progress: bool = True, leases: LeaseConfig = LeaseConfig(),
                    on_started: Callable[[Broker], None] | None = None) -> JobStatus:
    """Start the broker and config.num_stages stage processes, run the job on them, stop them; its status.

    `progress` shows a tqdm bar on stderr (only on a terminal: tqdm's disable=None). The run info
    (`layerbus status` shows where the layers went) is written once the stages are placed; `on_started`
    is given the broker then (the metrics endpoint reads it).
    """
    from tqdm import tqdm

    with LocalCluster(config, options) as cluster:
        for kind, message in cluster.broker.start_events:  # a stage process that ended while the model was placed
            store.add_job_event(job_id, kind, message)
        write_run_info(job_id, cluster.broker.run_info())
        if on_started is not None:
            on_started(cluster.broker)
        with tqdm(desc=job_id, unit="item", file=sys.stderr, disable=None if progress else True,
                  dynamic_ncols=True) as bar:
            return run_job(store, job_id, cluster.broker, results_dir, progress=bar, leases=leases)
