"""What the equivalence tests compare with: prompts for the tiny models, a run of N real stage processes, and the
check that each output equals transformers' greedy reference but where the reference itself shows a near-tie."""

from __future__ import annotations

from pathlib import Path

import torch

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.planner.batching import BatchingConfig
from tests.helpers.fixtures_models import reference_generate

NEAR_TIE = 1e-4
TINY_PROMPTS = [
    "The stage receives a batch",
    "What is the capital of France? Paris is the capital of France. How many legs does a spider have?",
    "Count from one to ten:",
    "A",
    "The broker keeps a queue of jobs. A worker claims a job, reports progress, and writes the answer to a table. "
    "If a worker stops sending heartbeats, its lease expires and the job goes back to the queue.",
    "Write a short poem about the sea.",
    "Small models are useful in tests because they load in a moment",
    "Numbers like 42",
    "Each process holds a contiguous range of layers",
    "Nothing is lost when a process dies, and nothing is done twice. Nothing is lost",
]


def top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_equivalent(model, requests, results, references=None, tie: float = NEAR_TIE) -> int:
    """Compare each result with its reference; a difference must come where the reference's top two
    logits are within `tie` (a lossy wire needs a looser one). Returns how many matched exactly."""
    exact = 0
    for i, (request, result) in enumerate(zip(requests, results)):
        assert result.error is None, f"{request.request_id}: {result.error}"
        expected = (references[i] if references is not None
                    else reference_generate(model, request.prompt_ids, request.max_new_tokens))
        got = result.token_ids
        if got == expected:
            exact += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        gap = top2_gap(model, request.prompt_ids + expected[:first])
        assert gap < tie, (f"{request.request_id}: token {first} differs ({got[first:first + 5]} vs reference "
                                f"{expected[first:first + 5]}) and the reference's top-2 gap there is {gap:.2e}, "
                                f"not a near-tie")
    return exact


def run_pipeline(model_dir: Path, num_stages: int, requests, num_slots: int, check=None, weights: str = "auto",
                 partition: str = "planned", **batching):
    config = BrokerConfig(str(model_dir), num_stages, weights=weights, partition=partition,
                          batching=BatchingConfig(num_slots=num_slots, **batching))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
        if check is not None:
            check(cluster.broker)
        results, stats = cluster.broker.generate(requests)
    return results, stats


def full_pass_scores(model, context: list[int], continuation: list[int]) -> tuple[torch.Tensor, list[bool]]:
    """What lm-evaluation-harness computes: one forward over context + continuation[:-1]."""
    ids = torch.tensor([context + continuation[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1:].float()
    targets = torch.tensor(continuation)
    log_probs = torch.log_softmax(logits, -1).gather(1, targets.unsqueeze(1)).squeeze(1)
    return log_probs, (logits.argmax(-1) == targets).tolist()
