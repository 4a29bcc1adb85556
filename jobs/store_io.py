"""A job's items in and out of the broker: StoreSource claims just what the broker asks for and turns each item
into its requests; StoreSink records finished items in batches, a Parquet part first, then the store."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Protocol

from layerbus.broker.requests import GenerationRequest, GenerationResult, ScoreRequest
from layerbus.jobs.claim_share import fair_claim
from layerbus.jobs.constraints import constraint_of
from layerbus.jobs.item_params import ADD_SPECIAL_TOKENS_KEY, PROMPT_IDS_KEY
from layerbus.jobs.leases import LeaseConfig, this_worker
from layerbus.jobs.document_split import EXTRA_KEY
from layerbus.jobs.logprobs import logprobs_json
from layerbus.jobs.long_documents import REDUCE_TEMPLATE, reduce_prompt_text
from layerbus.jobs.samples import parse_request_id, sample_request_id, sample_seed, samples_json, samples_of
from layerbus.jobs.score_items import is_scoring, score_output, score_request
from layerbus.jobs.tasks import RenderedPrompt, render_message
from layerbus.storage import ClaimedItem, ItemResult, JobSettings, JobStore
from layerbus.storage.result_row import result_row
from layerbus.storage.results import ResultWriter
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
        elif item.combine == "reduce":  # a long document's reduce: its prompt is made from its parts' outputs
            rendered = reduce_prompt(self.store, item, job, self.tokenizer)
            prompt_ids = self.tokenizer.encode(rendered.text, add_special_tokens=rendered.add_special_tokens,
                                               verbose=False)
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


def reduce_prompt(store: JobStore, item: ClaimedItem, settings: JobSettings, tokenizer: Any) -> RenderedPrompt:
    """A reduce's prompt: the summaries of its parts, in order, in the job's reduce template, rendered as the
    job's other prompts are. The same parts' outputs give the same prompt on every run."""
    long_documents = settings.extra.get(EXTRA_KEY) or {}
    template = long_documents.get("reduce_template") or REDUCE_TEMPLATE
    message = reduce_prompt_text(store.part_outputs(item.job_id, item.custom_id), template)
    return render_message(message, settings.task, tokenizer)


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
        # A long document's parts are no results of their own: the document's item is (storage/item_reads.py).
        rows = [row for result, rows in batch if not self._is_part(result.item_id) for row in rows]
        if rows:
            self.writer.write_part(rows)
        written = set(self.store.complete_items([result for result, _ in batch], holder=self.holder))
        skipped = [result.item_id for result, _ in batch if result.item_id not in written]
        if skipped:
            # Our lease ran out and another worker took them, or they were cancelled: the store keeps its
            # row, which finalize prefers over any part file's.
            log.warning("%d result(s) not recorded: those items are no longer held by this run (ids %s)",
                        len(skipped), skipped[:10])
        for result, _ in batch:
            self.claimed.pop(result.item_id, None)

    def _is_part(self, item_id: int) -> bool:
        item = self.claimed.get(item_id)
        return item is not None and item.parent_id is not None

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
