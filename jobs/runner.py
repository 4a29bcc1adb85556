"""Glue between a job in the store and the broker: claimed items become generation requests, finished
generations become result rows (a Parquet part, then the store), and `run_job` takes one job from
queued, or from a killed earlier run, to completed, cancelled or failed."""

from __future__ import annotations

import hashlib
import logging
import math
import socket
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from layerbus.broker.control import ClusterError, StagesGone
from layerbus.broker.requests import GenerationRequest, GenerationResult, ScoreRequest
from layerbus.jobs.claim_share import fair_claim
from layerbus.jobs.constraints import constraint_of
from layerbus.jobs.finalization import all_failed_message, finish_job  # noqa: F401 (all_failed_message: re-exported)
from layerbus.jobs.item_params import ADD_SPECIAL_TOKENS_KEY, PROMPT_IDS_KEY
from layerbus.jobs.logprobs import logprobs_json
from layerbus.jobs.leases import (LeaseConfig, LeaseKeeper, gone_holders, note_lost_workers, pid_alive,
                                  report_expired, this_worker)
from layerbus.jobs.score_items import is_scoring, score_output, score_request
from layerbus.jobs.samples import parse_request_id, sample_request_id, sample_seed, samples_json, samples_of
from layerbus.jobs.snapshot_keeper import SnapshotConfig, SnapshotKeeper
from layerbus.storage import ClaimedItem, ItemResult, JobSettings, JobStatus, JobStore, StoreError
from layerbus.storage.result_row import result_row
from layerbus.storage.results import ResultWriter
from layerbus.storage.states import FINAL_JOB_STATES, RUNNABLE_JOB_STATES
from layerbus.wire.sampling import SamplingParams

log = logging.getLogger("layerbus.jobs")



class ProgressBar(Protocol):
    """The part of tqdm's interface run_job uses."""

    def reset(self, total: int | None = None) -> None: ...

    def update(self, n: int = 1) -> Any: ...


class Runner(Protocol):
    """What run_job needs of a started broker."""

    def run(self, source: Any, sink: Any, should_stop: Callable[[], bool], events: Callable[..., None] | None) -> Any: ...

    def tokenizer(self) -> Any: ...


def item_seed(job_seed: int, seq: int) -> int:
    """An item's sampling seed when it gives none: differs between items, equal on every rerun."""
    digest = hashlib.blake2b(f"{job_seed}:{seq}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # < 2**63, as the input checks require of seeds


def default_worker_name() -> str:
    """This process's name in the store's claims ("host:pid:token", see jobs.leases.WorkerId)."""
    return str(this_worker())


class StoreSource:
    """A RequestSource over a job's queued items: each fetch claims just what the broker asks for."""

    def __init__(self, store: JobStore, job_id: str, tokenizer: Any, settings: JobSettings, worker_name: str,
                 lease_s: float = LeaseConfig().lease_s, peers: int = 1, clock: Callable[[], float] = time.monotonic):
        self.store, self.job_id, self.tokenizer, self.settings = store, job_id, tokenizer, settings
        self.worker_name, self.lease_s = worker_name, lease_s
        # Brokers working the job beside this one: each claim takes at most an even share of the queue
        # (jobs/claim_share.py). `peers` expected; the store's working brokers looked up now and then.
        self.peers, self.clock = peers, clock
        self._workers_seen: tuple[float, int] | None = None  # (when, working brokers in the store)
        # Items held when its share was last found in hand: until it holds fewer, the store is not asked
        # again (fetch runs every step; its share only grows back as its own items end)
        self._share_full_at: int | None = None
        # Claimed items whose results are not yet in the store: item_id -> item. StoreSink removes an
        # item once its result is committed; whatever is left when a run ends goes back to the store.
        self.outstanding: dict[int, ClaimedItem] = {}
        self._exhausted = False
        # Samples of claimed items not yet handed to the broker: an item of n samples is n requests, and a
        # fetch hands out no more than it is asked for.
        self._unsent: deque[GenerationRequest | ScoreRequest] = deque()
        # Samples per item the next claim expects: the job's n, then what the items claimed last had.
        self._samples_per_item = max(1, samples_of({}, settings.extra))

    @property
    def exhausted(self) -> bool:
        return self._exhausted and not self._unsent

    def fetch(self, limit: int, ahead: int = 0) -> list[GenerationRequest]:
        if limit < 1:
            return []
        if len(self._unsent) < limit and not self._exhausted:
            # Enough items for the samples asked for, at the samples per item seen so far.
            wanted = math.ceil((limit - len(self._unsent)) / self._samples_per_item)
            held = len(self.outstanding)
            if self._share_full_at is not None and held >= self._share_full_at:
                return self._hand_out(limit)  # its share still in hand
            workers = self._workers()
            if workers > 1:
                counts = self.store.job_status(self.job_id)
                ahead_items = min(wanted, math.ceil(max(0, ahead - len(self._unsent)) / self._samples_per_item))
                wanted = fair_claim(wanted, counts.queued, counts.in_progress, held, workers, ahead_items)
                if wanted == 0:  # its share is in hand: the others take the rest
                    self._share_full_at = held
                    return self._hand_out(limit)
            self._share_full_at = None
            claimed = self.store.claim_items(self.job_id, self.worker_name, wanted, lease_s=self.lease_s)
            if not claimed:  # nothing queued, or the job stopped handing out work (cancelled, ...)
                self._exhausted = True
            # Every claimed item is outstanding before any is tokenized: an interrupt (Ctrl-C) while tokenizing
            # then still hands them all back (_hand_back), none left in_progress under this worker's name.
            for item in claimed:
                self.outstanding[item.item_id] = item
            requests = 0
            for item in claimed:
                item_requests = self.requests_for(item)
                requests += len(item_requests)
                self._unsent.extend(item_requests)
            if claimed:  # the next claim expects the samples per item these had (items' own n may differ)
                self._samples_per_item = max(1, round(requests / len(claimed)))
        return self._hand_out(limit)

    def _hand_out(self, limit: int) -> list[GenerationRequest | ScoreRequest]:
        """Up to `limit` of the claimed items' requests not yet handed to the broker."""
        return [self._unsent.popleft() for _ in range(min(limit, len(self._unsent)))]

    WORKERS_REFRESH_S = 5.0  # how often the store's list of brokers working the job is read again

    def _workers(self) -> int:
        """Brokers working the job now, this one included: those the store lists working (renewed within
        their lease); the expected peers while fewer than that have registered (still starting)."""
        now = self.clock()
        if self._workers_seen is None or now - self._workers_seen[0] >= self.WORKERS_REFRESH_S:
            at = datetime.now(timezone.utc)
            workers = self.store.job_workers(self.job_id)
            working = sum(1 for w in workers if w.state_at(at) == "working")
            self._workers_seen = (now, self.peers if len(workers) < self.peers else working)
        return max(1, self._workers_seen[1])

    def requests_for(self, item: ClaimedItem) -> list[GenerationRequest | ScoreRequest]:
        """The item's requests: one per sample (jobs/samples.py), sample 0 exactly request_for's."""
        first = self.request_for(item)
        n = samples_of(item.params, self.settings.extra) if isinstance(first, GenerationRequest) else 1
        if n == 1:
            return [first]
        return [replace(first, request_id=sample_request_id(item.item_id, index, n),
                        sampling=replace(first.sampling, seed=sample_seed(first.sampling.seed, item.custom_id, index)))
                for index in range(n)]

    def request_for(self, item: ClaimedItem) -> GenerationRequest | ScoreRequest:
        """The item's own params override the job's settings."""
        params, job = item.params, self.settings
        if is_scoring(params):
            return score_request(str(item.item_id), params)
        sampling = SamplingParams(
            temperature=float(params.get("temperature", job.temperature)),
            top_k=int(params.get("top_k", job.top_k)),
            top_p=float(params.get("top_p", job.top_p)),
            seed=int(params.get("seed", item_seed(job.seed, item.seq))),
        )
        stop = params.get("stop", job.extra.get("stop", ()))
        # verbose=False: a prompt over the tokenizer's max length is the scheduler's to refuse, with a clearer message.
        if PROMPT_IDS_KEY in params:  # tokenized by whoever queued it (evals, as lm-eval tokenizes)
            prompt_ids = params[PROMPT_IDS_KEY]
        else:
            prompt_ids = self.tokenizer.encode(item.prompt, add_special_tokens=self._add_special_tokens(item),
                                               verbose=False)
        return GenerationRequest(request_id=str(item.item_id), prompt_ids=list(prompt_ids),
                                 max_new_tokens=int(params.get("max_tokens", job.max_new_tokens)),
                                 sampling=sampling, stop=tuple([stop] if isinstance(stop, str) else stop),
                                 constraint=constraint_of(params, job.extra),
                                 want_logprobs=bool(params.get("logprobs")), top_logprobs=int(params.get("top_logprobs", 0)),
                                 score_prompt=bool(params.get("prompt_logprobs")))

    def _add_special_tokens(self, item: ClaimedItem) -> bool:
        if ADD_SPECIAL_TOKENS_KEY in item.params:
            return bool(item.params[ADD_SPECIAL_TOKENS_KEY])
        # A job queued by another tool: a prompt that already starts with BOS was rendered by a chat template.
        bos = getattr(self.tokenizer, "bos_token", None)
        return not (bos and item.prompt.startswith(bos))


class StoreSink:
    """A ResultSink that records finished items in batches: a Parquet part first, then the store.

    Each result carries its text (decoded once, by the scheduler's detokenizer); the sink decodes nothing.

    Why that order: the store is the record of what is done, so an item is marked done only once its
    row is on disk. Killed between the two, the item is still in_progress in the store; the next run
    requeues and reruns it, and its new row lands in a later part. The final file keeps one row per
    custom_id (later parts win over earlier ones, and the store's rows, from item_results, win over
    every part), so the custom_id appears exactly once. Committing first would leave the parts
    missing an item the store calls done (finalize would still recover it from the store, but the
    parts would no longer hold every finished output).
    """

    def __init__(self, store: JobStore, writer: ResultWriter, claimed: MutableMapping[int, ClaimedItem],
                 flush_every: int = 64, flush_interval_s: float = 2.0, progress: ProgressBar | None = None,
                 clock: Callable[[], float] = time.monotonic, holder: str | None = None,
                 job_extra: dict[str, Any] | None = None):
        self.store, self.writer = store, writer
        # The job's settings.extra, for its --n (read from the store on first need when not given).
        self._extra = job_extra
        self.claimed = claimed  # StoreSource.outstanding: the items whose results may arrive
        # The worker the items were claimed as: the store records only what it still holds (None: no check).
        self.holder = holder
        self.flush_every, self.flush_interval_s = flush_every, flush_interval_s
        self.progress, self.clock = progress, clock
        self.pending: list[tuple[ItemResult, list[dict[str, Any]]]] = []
        # Finished samples of items with n > 1 whose other samples are still running: item_id -> {index: result}.
        # An item is recorded once all its samples are here; a run that ends before hands the item back whole.
        self.samples: dict[int, dict[int, GenerationResult]] = {}
        self.last_flush = clock()

    def deliver(self, results: list[GenerationResult]) -> None:
        done = 0
        for result in results:
            item_id, index = parse_request_id(result.request_id)
            item = self.claimed.get(item_id)
            if item is None:
                log.warning("result for item %s, which this run does not hold; dropped", result.request_id)
                continue
            n = 1 if is_scoring(item.params) else samples_of(item.params, self._job_extra())
            if n == 1:
                self.pending.append(self._record(item, result))
                done += 1
                continue
            finished = self.samples.setdefault(item_id, {})
            finished.setdefault(index, result)  # a late duplicate of a sample never replaces the first
            if len(finished) == n:
                del self.samples[item_id]
                self.pending.append(self._record_samples(item, [finished[i] for i in range(n)]))
                done += 1
        if self.progress is not None:
            self.progress.update(done)
        if len(self.pending) >= self.flush_every:
            self.flush()
        else:
            self.flush_if_due()

    def flush_if_due(self) -> None:
        if self.pending and self.clock() - self.last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> None:
        """Write the pending rows as a part file, then commit them to the store (see the class docstring)."""
        self.last_flush = self.clock()
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        self.writer.write_part([row for _, rows in batch for row in rows])
        written = set(self.store.complete_items([result for result, _ in batch], holder=self.holder))
        skipped = [result.item_id for result, _ in batch if result.item_id not in written]
        if skipped:
            # Our lease ran out and another worker took them, or they were cancelled: the store keeps its
            # row, which finalize prefers over any part file's.
            log.warning("%d result(s) not recorded: those items are no longer held by this run (ids %s)",
                        len(skipped), skipped[:10])
        for result, _ in batch:
            self.claimed.pop(result.item_id, None)

    def _job_extra(self) -> dict[str, Any]:
        if self._extra is None:
            self._extra = self.store.job_settings(next(iter(self.claimed.values())).job_id).extra
        return self._extra

    def _record_samples(self, item: ClaimedItem, results: list[GenerationResult]) -> tuple[ItemResult, list[dict]]:
        """One item of n > 1 samples: sample 0 in the item's own fields, the completion tokens summed (what
        the samples cost, as OpenAI's usage counts them), the first sample's error, and every sample in
        its samples field; one result row per sample."""
        recorded = [self._record(item, result, index)[0] for index, result in enumerate(results)]
        rows = [result_row(item, sample, index) for index, sample in enumerate(recorded)]
        error = next((f"sample {i}: {r.error}" for i, r in enumerate(recorded) if r.error is not None), None)
        first = recorded[0]
        combined = replace(first, completion_tokens=sum(r.completion_tokens for r in recorded),
                           latency_s=max(r.latency_s for r in recorded), error=error,
                           finish_reason="error" if error is not None else first.finish_reason,
                           samples=samples_json([vars(r) for r in recorded]))
        return combined, rows

    def _record(self, item: ClaimedItem, result: GenerationResult,
                sample_index: int = 0) -> tuple[ItemResult, list[dict[str, Any]]]:
        if result.text is None and result.token_ids:
            raise ValueError(f"result for item {item.item_id} has {len(result.token_ids)} token(s) but no text: "
                             "the broker's scheduler needs a detokenizer (Broker passes one)")
        if is_scoring(item.params):
            output = score_output(result)
        else:
            output = (result.text or "") if result.token_ids or result.error is None else None
        item_result = ItemResult(item_id=item.item_id, output=output, finish_reason=result.finish_reason,
                                 prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                                 latency_s=result.latency_s, error=result.error, logprobs=logprobs_json(result))
        return item_result, [result_row(item, item_result, sample_index)]


class StrandedWatch:
    """`should_stop` for the pipeline: true once this broker has waited `grace_s` for a stage to register
    (its chain lost stages and the rest cannot hold the model) while other brokers work the job. A broker
    alone on the job waits for as long as it takes; beside others it would hold its items (renewing their
    leases) while they finish everything else and wait for those items forever. Its run then ends, its
    items go back to the queue, and run_job leaves the job to the others (`_hand_over`)."""

    def __init__(self, store: JobStore, job_id: str, worker_name: str, grace_s: float,
                 clock: Callable[[], float] = time.monotonic, check_every_s: float = 1.0):
        self.store, self.job_id, self.worker_name, self.grace_s = store, job_id, worker_name, grace_s
        self.clock, self.check_every_s = clock, check_every_s
        self.waiting_since: float | None = None
        self.last_check = -math.inf
        self.left, self.reason = False, ""

    def watching(self, record: Callable[..., None]) -> Callable[..., None]:
        """The pipeline's event callback, passed on to `record`, noting when the broker starts and stops waiting."""
        def observe(kind: str, message: str, *args: Any, **fields: Any) -> None:
            if kind == "waiting":
                if self.waiting_since is None:
                    self.waiting_since = self.clock()
                self.reason = message
            elif kind == "recovered":
                self.waiting_since = None
            record(kind, message, *args, **fields)

        return observe

    def __call__(self) -> bool:
        if self.left:
            return True
        now = self.clock()
        if self.waiting_since is None or now - self.waiting_since < self.grace_s or now - self.last_check < self.check_every_s:
            return False
        self.last_check = now
        try:
            others = other_workers(self.store, self.job_id, self.worker_name)
        except Exception:  # noqa: BLE001 (the store unreachable: keep waiting, as a broker alone would)
            log.warning("job %s: could not look for other brokers", self.job_id, exc_info=True)
            return False
        if others:
            self.left = True
            self.reason = f"no stage for {now - self.waiting_since:.0f} s: {self.reason}"
        return self.left


class CancelWatch:
    """`should_stop` for the pipeline: true once the job no longer hands out work (cancelled, failed).

    Reads the store at most every `interval_s`, since the pipeline asks every few milliseconds.
    """

    def __init__(self, store: JobStore, job_id: str, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 states: tuple[str, ...] = RUNNABLE_JOB_STATES):
        self.store, self.job_id, self.interval_s, self.clock = store, job_id, interval_s, clock
        self.states = states  # true once the job's status is none of these
        self.stopping = False
        self.last_check = clock()

    def __call__(self) -> bool:
        now = self.clock()
        if not self.stopping and now - self.last_check >= self.interval_s:
            self.last_check = now
            status = self.store.job_status(self.job_id).status
            if status not in self.states:
                log.info("job %s is %s: finishing the items in flight, claiming no more", self.job_id, status)
                self.stopping = True
        return self.stopping


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


def other_workers(store: JobStore, job_id: str, worker_name: str) -> list[str]:
    """The other brokers working the job now (working or finalizing, their leases renewed in time)."""
    now = datetime.now(timezone.utc)
    return [w.worker for w in store.job_workers(job_id)
            if w.worker != worker_name and w.state_at(now) in ("working", "finalizing")]


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
