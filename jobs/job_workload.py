"""A queued job's workload for the planner: each generation item's prompt length (tokenized as the
runner will tokenize it), the leading blocks it shares with other items (what the prefix cache copies),
and its output budget, read from the store before the job runs.

A job of more than SAMPLE_ITEMS items is read as an evenly spread sample of them (JobStore.sample_items),
and its Workload says how many sequences the sample stands for: reading and tokenizing every item of a
million-item job took minutes before planning, for a plan that simulates only a sample anyway
(broker.job_simulation.job_shape, MAX_SIMULATED_ROWS)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from layerbus.broker.requests import GenerationRequest, ScoreRequest
from layerbus.planner.workload import ASSUMED_OUTPUT_SHARES, Workload
from layerbus.jobs.runner import StoreSource
from layerbus.jobs.samples import samples_of
from layerbus.jobs.tasks import TASKS
from layerbus.storage import ClaimedItem, JobStore, NewItem


HISTORY_JOBS = 20  # recent jobs looked at for where outputs ended
HISTORY_ITEMS = 2000  # finished items read at most
MIN_HISTORY_ITEMS = 8  # fewer say too little about where outputs end
# Items read (and their prompts tokenized) at most. Reading and tokenizing cost ~0.4-0.5 ms of CPU an
# item (200,000 60-word documents, 103-token prompts: 81-104 s of CPU, bench/bench_job_workload.py), so
# this is ~2 s however large the job (2.2 s of CPU for all of job_workload on a million). The plan's sums
# from the sample are off by what sampling gives: for items in random order whose prompt lengths vary as
# much as their mean, ~1/sqrt(4096) = 1.6% at one standard deviation; far less where lengths come in runs
# (tests/store/test_job_workload_sample.py). Halving that error would take four times the items (~8 s), and
# job_shape simulates at most MAX_SIMULATED_ROWS decode rows (781 items of 256 new tokens) anyway.
SAMPLE_ITEMS = 4096


def job_workload(store: JobStore, job_id: str, tokenizer: Any, sample_items: int = SAMPLE_ITEMS) -> Workload | None:
    """The generation items of `job_id` in queue order (items refused at submit have no prompt and
    are left out), with the shares of their budgets outputs are expected to use (`output_shares`);
    of a job of more than `sample_items` items, an evenly spread sample of that many, standing for
    all of them. Scoring items (evals) count as the positions they feed (scored_positions)."""
    settings = store.job_settings(job_id)
    source = StoreSource(store, job_id, tokenizer, settings, "planner")
    items, total = _items_to_read(store, job_id, settings.task, sample_items)
    prompts, budgets, samples = [], [], []
    read = 0
    for item in items:
        read += 1
        if not item.prompt and "prompt_ids" not in item.params:
            continue
        request = source.request_for(ClaimedItem(item_id=item.seq, job_id=job_id, custom_id=item.custom_id,
                                                 seq=item.seq, input=item.input, prompt=item.prompt,
                                                 params=item.params, attempts=0))
        if isinstance(request, ScoreRequest):
            # Scored as it is fed (broker/scoring.py): each context once, then every continuation after it,
            # nothing generated. Planned as that many prompt positions and one new token: the KV caches, the
            # slots and the step budget are sized from the job's own lengths, not from generation defaults.
            prompts.append(scored_positions(request))
            budgets.append(1)
        elif isinstance(request, GenerationRequest):
            prompts.append(request.prompt_ids)
            budgets.append(request.max_new_tokens)
        else:
            return None
        samples.append(samples_of(item.params, source.settings.extra))  # each of an item's n samples is a sequence
    # Sequences the sample stands for: its own, as many times over as the job has items per item read
    # (refused items and n > 1 samples are then as frequent in the job as in the sample).
    sequences = sum(samples)
    represents = round(sequences * total / read) if sequences and total is not None and total > read else None
    workload = Workload.of_prompts(prompts, budgets, 1.0, represents, samples=samples)
    shares = output_shares(store, job_id, settings.model, settings.task)
    if not shares:  # nothing like it has ended yet: the outputs end somewhere up to their budgets
        return workload.with_output_shares(ASSUMED_OUTPUT_SHARES, assumed=True) if workload.items else workload
    return workload.with_output_shares(shares)


def scored_positions(request: ScoreRequest) -> list[int]:
    """The tokens a scoring request feeds, as one prompt: each segment's context, then its continuations
    (their first blocks shared with other requests' where the contexts are, as the prefix cache shares them)."""
    fed: list[int] = []
    for segment in request.segments:
        fed += segment.context_ids
        for continuation in segment.continuations:
            fed += continuation
    return fed


def _items_to_read(store: JobStore, job_id: str, task: str, sample_items: int) -> tuple[Iterable[NewItem], int | None]:
    """(the items to read, how many items the job has; None: they are all of them).

    Only jobs of the tasks `layerbus submit` queues are sampled: their items are never scoring ones. A
    job queued by evals may mix a few scoring items among many generation ones, which a sample could
    miss, and a scoring item anywhere means no workload; such a job is read whole, as before."""
    if task not in TASKS:
        return store.job_items(job_id), None
    sample = store.sample_items(job_id, sample_items)
    return sample.items, sample.total


def output_shares(store: JobStore, job_id: str, model: str, task: str) -> list[float]:
    """Where outputs end is known only once they have run: per finished item of recent jobs with the
    same model and task (this job's own, when it is resumed, included), the share of its budget it
    used. An empty list (the job's outputs are then assumed to end evenly up to their budgets,
    ASSUMED_OUTPUT_SHARES) without at least MIN_HISTORY_ITEMS."""
    shares: list[float] = []
    for job in store.list_jobs(HISTORY_JOBS):
        if job.model != model or job.task != task or len(shares) >= HISTORY_ITEMS:
            continue
        if not job.completed:  # nothing to learn, and paging through a million queued items finds none: 1.8 s
            continue
        max_new = store.job_settings(job.job_id).max_new_tokens
        for row in store.item_results(job.job_id):
            if len(shares) >= HISTORY_ITEMS:
                break  # stop reading: a million-item job in the history would take half a minute to read
            if row["status"] != "completed" or row["finish_reason"] not in ("stop", "length"):
                continue
            tokens = int(row["completion_tokens"] or 0)
            budget = max(max_new, tokens, 1)  # an item's own max_tokens may exceed the job's
            shares.append(min(1.0, max(tokens / budget, 1e-3)))
    return shares if len(shares) >= MIN_HISTORY_ITEMS else []
