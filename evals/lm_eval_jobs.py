"""lm-eval's items as one layerbus job on local stages, found again by name: an interrupted evaluation
resumes where it stopped, a finished one is read back without starting a stage.

The job's name is a digest of the model directory's fingerprint and every item's params
(evals/lm_eval_items.py job_name), so the same lm-eval call over the same model meets its earlier job:
- queued, in_progress or finalizing (an interrupted run): run again; run_job requeues the items left in
  flight and keeps the completed ones, which are not recomputed;
- completed with every item completed: its outputs are read, no stage is started;
- failed, cancelled(-ling), or completed with failed items: a fresh job is queued under the same name
  (the newest wins the next lookup); the old one stays in the store for `layerbus status`.
One lm-eval process per job at a time: a second would requeue the first one's items in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerbus.evals.lm_eval_items import PlannedItem, job_name
from layerbus.storage import JobSettings, JobStatus, JobStore, NewItem, default_db_url, default_results_dir
from layerbus.storage.states import FINAL_JOB_STATES

log = logging.getLogger("layerbus.evals")

JOB_TASK = "lm-eval"
# Job states in which the earlier job is resumed rather than replaced.
RESUMABLE_STATES = ("queued", "in_progress", "finalizing")
# Failed items named in an error message; the rest are counted.
ERRORS_SHOWN = 5


class LayerbusEvalError(RuntimeError):
    """A layerbus job could not give lm-eval every answer it asked for."""


@dataclass(frozen=True)
class LocalPipeline:
    """Where and how lm-eval's items run: a store, a model directory, stages on this machine."""

    model_dir: Path
    stages: int = 1
    db: str | None = None  # store URL; None is layerbus's default store (SQLite under $LAYERBUS_HOME)
    max_context: int = 2048  # the broker's per-sequence budget: lm-eval's max_length
    wire: str = "float32"  # codec of the hidden states between stages (one name, or "auto")
    threads_per_stage: int = 0  # 0 shares this machine's cores between the stages
    partition: str = "planned"  # how layers are placed, as `layerbus run --partition`
    device: str = "cpu"
    dtype: str = "float32"
    progress: bool = True  # a tqdm bar on stderr while the job runs (on a terminal only)
    # The model directory's fingerprint (models/fingerprint.py); part of every job name.
    model_identity: dict[str, Any] = field(default_factory=dict)

    def numerics(self) -> dict[str, str]:
        """Settings that change the numbers, so a job computed one way is never re-read for another."""
        return {"wire": self.wire, "device": self.device, "dtype": self.dtype}


@dataclass(frozen=True)
class JobOutputs:
    """The output column of every item, in item order, and the job that holds them."""

    job_id: str
    outputs: tuple[str, ...]
    reused: bool  # read from an earlier completed job: no stage was started


def run_items(pipeline: LocalPipeline, kind: str, items: Sequence[PlannedItem]) -> JobOutputs:
    """Find or queue the job for `items`, run it on local stages unless it is complete, return the outputs.

    LayerbusEvalError when the job did not complete or any item failed (lm-eval cannot use a missing score).
    KeyboardInterrupt propagates with the job left in_progress: calling again resumes it.
    """
    if not items:
        return JobOutputs("", (), reused=False)
    name = job_name(pipeline.model_identity, kind, pipeline.numerics(), items)
    with JobStore.open(pipeline.db or default_db_url()) as store:
        job_id = earlier_job(store, name, len(items))
        if job_id is None:
            job_id = store.create_job(job_settings(pipeline, kind, name), new_items(items))
            log.info("lm-eval %s: queued %s (%d item(s)) in %s", kind, job_id, len(items), store.url)
        status = store.job_status(job_id)
        reused = status.status in FINAL_JOB_STATES
        if not reused:
            status = _run(store, job_id, pipeline)
        return JobOutputs(job_id, read_outputs(store, status, len(items)), reused)


def earlier_job(store: JobStore, name: str, item_count: int) -> str | None:
    """The job of this name to resume or re-read, or None when a fresh one must be queued."""
    job_id = store.find_job_by_name(name)
    if job_id is None:
        return None
    status = store.job_status(job_id)
    if status.total != item_count:  # the name is a digest of the items: this would be a bug, not a user error
        raise LayerbusEvalError(f"job {job_id} is named {name} but holds {status.total} items, not {item_count}: "
                                f"the store {store.url} was edited by hand? Delete the job or use another db")
    if status.status in RESUMABLE_STATES:
        log.info("lm-eval: resuming %s (%d of %d item(s) already completed)", job_id, status.completed, status.total)
        return job_id
    if status.status == "completed" and status.completed == status.total:
        log.info("lm-eval: re-reading the outputs of %s, completed earlier", job_id)
        return job_id
    log.warning("lm-eval: the earlier job %s of these requests is %s with %d failed item(s); queueing a fresh one",
                job_id, status.status, status.failed)
    return None


def job_settings(pipeline: LocalPipeline, kind: str, name: str) -> JobSettings:
    return JobSettings(task=JOB_TASK, model=str(pipeline.model_dir), name=name, temperature=0.0,
                       extra={"lm_eval_request": kind, "max_length": pipeline.max_context})


def new_items(items: Sequence[PlannedItem]) -> list[NewItem]:
    # custom_id is the item's index: the outputs are read back into that order.
    return [NewItem(custom_id=str(index), input=item.input, prompt="", params=item.params, seq=index)
            for index, item in enumerate(items)]


def _run(store: JobStore, job_id: str, pipeline: LocalPipeline) -> JobStatus:
    # Imported here: the broker and the stages' launcher are needed only when something is left to compute.
    from layerbus.broker.broker import BrokerConfig
    from layerbus.broker.control import ClusterError
    from layerbus.launch.local_cluster import LocalStageOptions
    from layerbus.planner.batching import BatchingConfig
    from layerbus.launch.local_run import run_job_locally, stage_log_dir

    log_dir = stage_log_dir(job_id)
    config = BrokerConfig(str(pipeline.model_dir), pipeline.stages, partition=pipeline.partition,
                          batching=BatchingConfig(max_context=pipeline.max_context), wire=pipeline.wire)
    options = LocalStageOptions(threads_per_stage=pipeline.threads_per_stage, device=pipeline.device,
                                dtype=pipeline.dtype, log_dir=log_dir)
    log.info("lm-eval: running %s on %d local stage(s); stage logs in %s", job_id, pipeline.stages, log_dir)
    try:
        return run_job_locally(store, job_id, config, options, default_results_dir(), progress=pipeline.progress)
    except ClusterError as error:
        raise LayerbusEvalError(f"{error}\nstage logs: {log_dir}; job {job_id} keeps its finished items: "
                                "calling again (the same lm-eval command) resumes it") from None


def read_outputs(store: JobStore, status: JobStatus, item_count: int) -> tuple[str, ...]:
    """Every item's output in custom_id order; LayerbusEvalError naming the job and its failed items otherwise."""
    job_id = status.job_id
    if status.status != "completed":
        raise LayerbusEvalError(f"job {job_id} ended {status.status}" + (f": {status.error}" if status.error else "")
                                + f"; `layerbus status {job_id}` shows its events, stage logs are in "
                                f"$LAYERBUS_HOME/logs/{job_id}; calling again queues a fresh job")
    outputs: dict[int, str] = {}
    failed: list[str] = []
    for row in store.item_results(job_id):
        if row["status"] == "completed" and row["output"] is not None:
            outputs[int(row["custom_id"])] = row["output"]
        else:
            failed.append(f"item {row['custom_id']}: {row['status']}: {row['error'] or 'no output'}")
    missing = item_count - len(outputs) - len(failed)
    if failed or missing:
        shown = "\n  ".join(failed[:ERRORS_SHOWN]) + (f"\n  ... and {len(failed) - ERRORS_SHOWN} more"
                                                       if len(failed) > ERRORS_SHOWN else "")
        raise LayerbusEvalError(f"job {job_id}: {len(failed)} of {item_count} item(s) failed"
                                + (f" and {missing} have no result" if missing else "") + " (lm-eval needs every "
                                f"score):\n  {shown}\n`layerbus status {job_id}` shows the job; calling again "
                                "queues a fresh job for these requests")
    return tuple(outputs[index] for index in range(item_count))
