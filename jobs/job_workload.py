"""A queued job's workload for the planner: each generation item's prompt length (tokenized as the
runner will tokenize it) and output budget, read from the store before the job runs."""

from __future__ import annotations

from typing import Any

from layerbus.broker.requests import GenerationRequest
from layerbus.broker.workload import Workload
from layerbus.jobs.runner import StoreSource
from layerbus.storage import ClaimedItem, JobStore


def job_workload(store: JobStore, job_id: str, tokenizer: Any) -> Workload | None:
    """The generation items of `job_id` in queue order (items refused at submit have no prompt and
    are left out). Outputs are assumed to run to their budgets: where they end at EOS is not known
    before they run. None for a job with scoring items (evals): their chunks are cut at the step
    budget, which must not move with the job, and they generate nothing to plan for."""
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
        prompts.append(len(request.prompt_ids))
        budgets.append(request.max_new_tokens)
    return Workload.of(prompts, budgets)
