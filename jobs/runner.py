"""Glue between a job in the store and the broker: claimed items become generation requests, finished
generations become result rows (a Parquet part, then the store), and `run_job` takes one job from
queued, or from a killed earlier run, to completed, cancelled or failed."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from layerbus.broker.control import ClusterError, StagesGone
from layerbus.jobs.finalization import all_failed_message, finish_job  # noqa: F401 (all_failed_message: re-exported)
from layerbus.jobs.leases import (LeaseConfig, LeaseKeeper, gone_holders, note_lost_workers, pid_alive,
                                  report_expired)
from layerbus.jobs.snapshot_keeper import SnapshotConfig, SnapshotKeeper
from layerbus.storage import JobSettings, JobStatus, JobStore, StoreError
from layerbus.storage.results import ResultWriter
from layerbus.storage.states import FINAL_JOB_STATES, RUNNABLE_JOB_STATES
from layerbus.jobs.run_watches import CancelWatch, StrandedWatch, other_workers  # noqa: F401 - re-exported
from layerbus.jobs.store_io import (  # noqa: F401 - re-exported: what tests and tools import from here
    ProgressBar,
    Runner,
    StoreSink,
    StoreSource,
    default_worker_name,
    item_seed,
)

log = logging.getLogger("layerbus.jobs")


def run_job(store: JobStore, job_id: str, broker: Runner, results_dir: Path, progress: ProgressBar | None = None,
            poll_cancel_s: float = 1.0, worker_name: str | None = None,
            leases: LeaseConfig = LeaseConfig(), snapshots: SnapshotConfig = SnapshotConfig()) -> JobStatus:
    """Run a job on a started broker until it is completed, cancelled or failed; returns its status.

    Items an earlier run left in_progress go back to the queue first when nobody holds them any more
    (their lease ran out, or their broker was a process of this machine that has exited), so this also
    resumes a job; items other brokers hold are theirs until their leases run out (jobs/leases.py). Any
    number of brokers may run one job at once: each writes its own part files, and exactly one of them
    finalizes the job while the others wait for it to end (jobs/finalization.py). An exception fails the
    job with its text (finished outputs stay in the store and the part files), unless another broker is
    finalizing it; KeyboardInterrupt requeues the items in flight, leaves the job in_progress for a
    later run, and propagates. While the pipeline runs, the broker's stage snapshots go to the store
    every `snapshots.interval_s` (jobs/snapshot_keeper.py), for `layerbus top`.
    """
    status = store.job_status(job_id)
    if status.status in FINAL_JOB_STATES and (status.status != "cancelled" or status.results_path):
        log.info("job %s is already %s: nothing to run", job_id, status.status)
        return status
    worker_name = worker_name or default_worker_name()
    _take_back_abandoned(store, job_id, worker_name)
    if status.status == "queued":
        _try_set_status(store, job_id, "in_progress")
    settings = store.job_settings(job_id)
    # Its own part folder: brokers sharing results_dir (one machine, or a shared folder) never collide.
    writer = ResultWriter(Path(results_dir), job_id, writer=worker_name)
    store.register_worker(job_id, worker_name, socket.gethostname(), _chain_text(broker), leases.lease_s)
    describe = getattr(broker, "placement_summary", None)
    if callable(describe) and status.status in RUNNABLE_JOB_STATES:
        store.add_job_event(job_id, "placed", describe())
        links = getattr(broker, "link_matrix_report", None)
        report = links() if callable(links) else ""
        if report:  # the links the plan priced: measured between the stages, or from a network file
            store.add_job_event(job_id, "links", report)
    try:
        if status.status in RUNNABLE_JOB_STATES:  # finalizing: stopped while writing its results, only that is left
            with LeaseKeeper(store, job_id, worker_name, leases), \
                    _snapshot_keeper(store, job_id, broker, worker_name, snapshots):
                _run_rounds(store, job_id, broker, writer, settings, progress, poll_cancel_s, worker_name, leases)
        return finish_job(store, job_id, writer, settings, worker_name, leases, wait=_waiter(store, job_id, broker))
    except StagesGone as gone:  # no stage left, none can come back: the job waits for a later run, as it is
        _event_recorder(store, job_id)("worker_left", f"{worker_name} stopped: {gone}; the job stays "
                                                      f"{store.job_status(job_id).status} for a later run")
        raise
    except Exception as error:
        # A broken cluster is explained by its message (and the stage logs); anything else may be a bug.
        log.error("job %s failed: %s", job_id, error, exc_info=not isinstance(error, ClusterError))
        if _finalized_elsewhere(store, job_id, worker_name):
            return store.job_status(job_id)
        if isinstance(error, ClusterError) and _hand_over(store, job_id, worker_name, error):
            return store.job_status(job_id)
        _try_set_status(store, job_id, "failed", error=f"{type(error).__name__}: {error}")
        return store.job_status(job_id)
    finally:
        _stopped(store, job_id, worker_name)


def _chain_text(broker: Runner) -> str | None:
    """The broker's chain in text form ("stage-0 [0, 15) -> stage-1 [15, 30)"), or None when it has none."""
    placement = getattr(broker, "placement", None)
    text = getattr(placement, "text", None)
    return text() if callable(text) else None


def _waiter(store: JobStore, job_id: str, broker: Runner) -> Callable[[float], None]:
    """How to wait while another broker finalizes: with the stages kept alive where the broker can."""
    keep_alive = getattr(broker, "keep_alive", None)
    if not callable(keep_alive):
        return time.sleep
    # A stage lost meanwhile that the rest cannot do without is waited for only while the other finalizes.
    finalizing = CancelWatch(store, job_id, 1.0, states=("finalizing",))
    return lambda seconds: keep_alive(seconds, report=_event_recorder(store, job_id), should_stop=finalizing)


def _finalized_elsewhere(store: JobStore, job_id: str, worker_name: str) -> bool:
    """Whether another worker is finalizing the job: this worker's failure is then no failure of the job."""
    try:
        holder = store.job_finalization(job_id)
    except Exception:  # noqa: BLE001 (the store itself failing: fail the job as before, if that still works)
        return False
    return holder.status == "finalizing" and holder.holder not in (None, worker_name)


def _hand_over(store: JobStore, job_id: str, worker_name: str, error: ClusterError) -> bool:
    """When this broker's own stages broke while other brokers work the job: its items in flight go back
    to the queue at once (not after its lease) and the job stays theirs, in progress; True. A chain that
    breaks is this broker's failure, not the job's: failing the job would stop every other chain on it.
    False when no other broker is working it (the job then fails as before)."""
    try:
        others = other_workers(store, job_id, worker_name)
        if not others:
            return False
        # Its items in flight went back to the queue already (_hand_back, at the end of its run).
        message = (f"{worker_name} left the job, its stages broken ({error}); the items it held went back to the "
                   f"queue for {len(others)} other broker(s): {', '.join(others)}")
        log.error("job %s: %s", job_id, message)
        store.add_job_event(job_id, "worker_left", message)
        return True
    except Exception:  # noqa: BLE001 (the store failing too: fail the job as before, if that still works)
        log.warning("job %s: could not hand the job over to the other brokers", job_id, exc_info=True)
        return False


def _stopped(store: JobStore, job_id: str, worker_name: str) -> None:
    """Mark this worker stopped on the job (status lists it so); never what stops a run from returning."""
    try:
        store.set_worker_state(job_id, worker_name, "stopped")
    except Exception:  # noqa: BLE001
        log.warning("job %s: could not mark worker %s stopped", job_id, worker_name, exc_info=True)


def _snapshot_keeper(store: JobStore, job_id: str, broker: Runner, worker_name: str,
                     config: SnapshotConfig) -> AbstractContextManager:
    """Stage snapshots for `layerbus top`, from a broker that can take them (test doubles may not)."""
    take = getattr(broker, "stage_snapshots", None)
    if not config.enabled or not callable(take):
        return nullcontext()
    return SnapshotKeeper(store, job_id, worker_name, take, config)


def _take_back_abandoned(store: JobStore, job_id: str, worker_name: str) -> None:
    """Requeue the items whose holder is gone (its lease ran out, or its process on this host exited, or it
    is this process's own earlier run); record how many and why as a `resumed` event."""
    note_lost_workers(store, job_id, worker_name)
    leases = store.job_leases(job_id)
    gone = gone_holders(leases, worker_name, socket.gethostname(), pid_alive)
    taken = store.requeue_expired(job_id, holders=gone)
    for holder, count in taken.items():
        why = "its process has exited" if holder in gone else "its lease ran out"
        if holder == worker_name:
            why = "an earlier run in this process ended without handing them back"
        message = (f"{count} item(s) left in progress by {holder or 'an unnamed worker'} went back to the queue "
                   f"({why}); committed items are kept")
        log.info("job %s: %s", job_id, message)
        store.add_job_event(job_id, "resumed", message)
    for lease in leases:
        if lease.holder not in taken and lease.holder not in gone:
            log.info("job %s: %d item(s) held by %s, leased until %s: theirs unless the lease runs out",
                     job_id, lease.items, lease.holder, lease.expires_at)


def _run_rounds(store: JobStore, job_id: str, broker: Runner, writer: ResultWriter, settings: JobSettings,
                progress: ProgressBar | None, poll_cancel_s: float, worker_name: str, leases: LeaseConfig) -> None:
    """Run the pipeline until the job has nothing queued (items requeued meanwhile get another round), then
    wait while other workers hold items: they finish them, or their leases run out and they come back here."""
    tokenizer = broker.tokenizer()
    while True:
        status = store.job_status(job_id)
        if status.queued == 0 and status.in_progress > 0:
            _wait_for_other_holders(store, job_id, broker, status.in_progress, leases, worker_name)
            status = store.job_status(job_id)
            if status.status not in RUNNABLE_JOB_STATES or status.queued == 0:
                return
        if progress is not None:
            progress.reset(total=status.total)
            progress.update(status.completed + status.failed + status.cancelled)
        source = StoreSource(store, job_id, tokenizer, settings, worker_name, leases.lease_s, peers=leases.peers)
        sink = StoreSink(store, writer, source.outstanding, progress=progress, holder=worker_name,
                         job_extra=settings.extra)
        watch = CancelWatch(store, job_id, poll_cancel_s)
        stranded = StrandedWatch(store, job_id, worker_name, grace_s=leases.lease_s)

        def should_stop() -> bool:
            sink.flush_if_due()  # the pipeline calls this every loop: the sink's clock tick
            return watch() or stranded()

        try:
            events = _chain_follower(store, job_id, broker, worker_name, leases, _event_recorder(store, job_id))
            broker.run(source, sink, should_stop=should_stop, events=stranded.watching(events))
        finally:
            _hand_back(store, sink, source)
        if stranded.left:
            raise ClusterError(stranded.reason)
        status = store.job_status(job_id)
        if watch.stopping or status.status not in RUNNABLE_JOB_STATES:
            return
        if status.queued == 0 and status.in_progress == 0:
            return


def _wait_for_other_holders(store: JobStore, job_id: str, broker: Runner, in_flight: int,
                            leases: LeaseConfig, worker_name: str) -> None:
    """While other workers hold the job's last items and nothing is queued: keep the stages alive (the
    broker's keep_alive, where it has one) until those items finish, come back (the LeaseKeeper requeues
    them once their leases run out), or the job stops being runnable.

    A stage lost meanwhile is re-planned around as in a run. If the rest cannot hold the model, the broker
    waits for a stage only while the job is runnable, and beside other brokers for one lease (as in a run,
    StrandedWatch), then leaves the job to them (ClusterError): a chain idle at the job's end must not wait
    for ever for a stage while the others finish the job."""
    log.info("job %s: nothing queued, %d item(s) in flight with other workers: waiting for them to finish "
             "or for their leases to run out", job_id, in_flight)
    keep_alive = getattr(broker, "keep_alive", None)
    watch = CancelWatch(store, job_id, 1.0)
    stranded = StrandedWatch(store, job_id, worker_name, grace_s=leases.lease_s)
    record = stranded.watching(_chain_follower(store, job_id, broker, worker_name, leases, _event_recorder(store, job_id)))
    while True:
        status = store.job_status(job_id)
        if status.status not in RUNNABLE_JOB_STATES or status.queued > 0 or status.in_progress == 0:
            return
        if callable(keep_alive):
            keep_alive(leases.renew_every_s, report=record, should_stop=lambda: watch() or stranded())
            if stranded.left:
                raise ClusterError(stranded.reason)
        else:
            time.sleep(leases.renew_every_s)


def _chain_follower(store: JobStore, job_id: str, broker: Runner, worker_name: str, leases: LeaseConfig,
                    record: Callable[..., None]) -> Callable[..., None]:
    """The pipeline's event callback, passed on to `record`; after a re-plan (a lost stage, a slowed one, one
    that joined) the broker's new chain is recorded as this worker's, so `layerbus status JOB` shows the
    chain in use."""
    def follow(kind: str, message: str, *args: Any, **fields: Any) -> None:
        record(kind, message, *args, **fields)
        if kind in ("recovered", "rebalanced", "grown"):
            try:
                store.register_worker(job_id, worker_name, socket.gethostname(), _chain_text(broker), leases.lease_s)
            except Exception:  # noqa: BLE001 (a figure for status: never what stops the job)
                log.warning("job %s: could not record the new chain", job_id, exc_info=True)

    return follow


def _event_recorder(store: JobStore, job_id: str) -> Callable[..., None]:
    def record(kind: str, message: str, duration_s: float | None = None, **_fields: Any) -> None:
        try:  # the record of a recovery must never be what stops the job
            store.add_job_event(job_id, kind, message, duration_s)
        except Exception:  # noqa: BLE001
            log.exception("job %s: could not record event %s", job_id, kind)

    return record


def _hand_back(store: JobStore, sink: StoreSink, source: StoreSource) -> None:
    """Commit what finished; claimed items without a result go back to the store.

    They go back to the queue (only those this worker still holds), or are cancelled when the job is
    cancelling. What goes back is what the store lists under this worker's name, not only the source's
    own list: an interrupt (Ctrl-C) can land after a claim committed and before claim_items returned,
    and those items, never seen here, would otherwise wait out this worker's lease.
    """
    try:
        sink.flush()
    finally:
        leftovers = len(source.outstanding)
        source.outstanding.clear()
        # Counts only what went back to the queue (a cancelling job's items are cancelled instead). Other
        # holders' items whose lease has run out go back with them, and are said as the keeper says them: a
        # hand-back just after a killed broker's lease expired took its items, and no event said so.
        taken = store.requeue_expired(source.job_id, holders=[source.worker_name])
        requeued = taken.pop(source.worker_name, 0)
        try:
            report_expired(store, source.job_id, taken)
        except Exception:  # noqa: BLE001 (a record: never what replaces the error being handled)
            log.exception("job %s: could not record the expired leases of %s", source.job_id, ", ".join(taken))
        if leftovers or requeued:
            unseen = max(0, requeued - leftovers)
            log.info("job %s: %d unfinished item(s) handed back (or cancelled with the job)%s", source.job_id,
                     max(leftovers, requeued),
                     f", {unseen} of them claimed as the run stopped" if unseen else "")


def _try_set_status(store: JobStore, job_id: str, status: str, error: str | None = None) -> bool:
    """Move the job unless someone moved it first (a cancel, typically); False then."""
    try:
        store.set_job_status(job_id, status, error=error)
        return True
    except StoreError as refused:
        log.info("job %s not moved to %s: %s", job_id, status, refused)
        return False
