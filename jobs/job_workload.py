"""A queued job's workload for the planner: each generation item's prompt length (tokenized as the
runner will tokenize it) and output budget, read from the store before the job runs."""

from __future__ import annotations

from typing import Any

from layerbus.broker.requests import GenerationRequest
from layerbus.broker.workload import Workload
from layerbus.jobs.runner import StoreSource
from layerbus.jobs.samples import samples_of
from layerbus.storage import ClaimedItem, JobStore


HISTORY_JOBS = 20  # recent jobs looked at for where outputs ended
HISTORY_ITEMS = 2000  # finished items read at most
MIN_HISTORY_ITEMS = 8  # fewer say too little about where outputs end


def job_workload(store: JobStore, job_id: str, tokenizer: Any) -> Workload | None:
    """The generation items of `job_id` in queue order (items refused at submit have no prompt and
    are left out), with the share of their budgets outputs are expected to use (`output_fraction`).
    None for a job with scoring items (evals): their chunks are cut at the step budget, which must
    not move with the job, and they generate nothing to plan for."""
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "planner")
    prompts, budgets = [], []
    for item in store.job_items(job_id):
        if not item.prompt and "prompt_ids" not in item.params:
            continue
        request = source.request_for(ClaimedItem(item_id=item.seq, job_id=job_id, custom_id=item.custom_id,
                                                 seq=item.seq, input=item.input, prompt=item.prompt,
                                                 params=item.params, attempts=0))
        if not isinstance(request, GenerationRequest):
            return None
        samples = samples_of(item.params, source.settings.extra)  # each of an item's n samples is a sequence
        prompts.extend([len(request.prompt_ids)] * samples)
        budgets.extend([request.max_new_tokens] * samples)
    settings = store.job_settings(job_id)
    return Workload.of(prompts, budgets, output_fraction(store, job_id, settings.model, settings.task))


def output_fraction(store: JobStore, job_id: str, model: str, task: str) -> float:
    """Where outputs end is known only once they have run: the share of their budgets that finished
    items of recent jobs with the same model and task used (this job's own, when it is resumed,
    included). 1.0 (every item runs to its budget) without at least MIN_HISTORY_ITEMS of them."""
    used = budget = items = 0
    for job in store.list_jobs(HISTORY_JOBS):
        if job.model != model or job.task != task or items >= HISTORY_ITEMS:
            continue
        max_new = store.job_settings(job.job_id).max_new_tokens
        for row in store.item_results(job.job_id):
            if items >= HISTORY_ITEMS:
                break  # stop reading: a million-item job in the history would take half a minute to read
            if row["status"] != "completed" or row["finish_reason"] not in ("stop", "length"):
                continue
            tokens = int(row["completion_tokens"] or 0)
            used += tokens
            budget += max(max_new, tokens)  # an item's own max_tokens may exceed the job's
            items += 1
    if items < MIN_HISTORY_ITEMS or budget <= 0:
        return 1.0
    return min(1.0, max(used / budget, 1e-3))
