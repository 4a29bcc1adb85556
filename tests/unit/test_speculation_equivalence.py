"""Speculation on against off, through the real scheduler, step rows, packed forward steps and last-stage picks of
a tiny model in one process: the same tokens, text, finish reasons and log-probs, greedy and seeded sampling,
1-3 stages, stop strings, max_tokens, n samples of one prompt, and constrained decoding. The verification path
must be exercised both ways (drafts accepted and drafts rejected), or the comparison proves nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from layerbus.broker.requests import GenerationRequest
from layerbus.jobs.samples import sample_seed
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.speculation import SpeculationConfig
from layerbus.wire.sampling import SamplingParams
from tests.helpers.constrained_items import check_output, mixed_requests
from tests.helpers.equivalence import TINY_PROMPTS
from tests.helpers.inprocess_chain import InProcessChain, drive, new_scheduler

SPANS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
SAMPLED = [SamplingParams(), SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.0, top_k=5, seed=3),
           SamplingParams(temperature=0.7, top_p=0.9, seed=5)]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama", num_hidden_layers=4)


def requests_for(model_dir) -> list[GenerationRequest]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = []
    for i, prompt in enumerate(TINY_PROMPTS):
        ids = tokenizer(prompt).input_ids
        requests.append(GenerationRequest(f"p{i}", ids, max_new_tokens=8 + (i * 7) % 29, sampling=SAMPLED[i % 4],
                                          want_logprobs=True, top_logprobs=2 if i % 3 == 0 else 0,
                                          stop=("e", "a") if i % 5 == 4 else ()))
    # n = 3 samples of one prompt, each with its own seed, as a job's samples are.
    ids = tokenizer(TINY_PROMPTS[1]).input_ids
    for k in range(3):
        requests.append(GenerationRequest(f"n{k}", ids, max_new_tokens=24,
                                          sampling=SamplingParams(temperature=0.9, seed=sample_seed(7, "n", k))))
    return requests


class KnowingDrafter:
    """Proposes what a run without drafts produced after the same tokens, with every third proposal's last draft
    changed: drafts that are right in part, so verification accepts some and rejects the rest. (A random tiny
    model's outputs repeat nothing, so a real drafter's proposals would all be rejected.)"""

    def __init__(self, requests, results: dict):
        self.after: dict[tuple[int, ...], list[int]] = {}
        for request in requests:
            output = results[request.request_id].token_ids
            for j in range(1, len(output)):
                self.after.setdefault(tuple(request.prompt_ids) + tuple(output[:j]), output[j:])
        self.calls = 0

    def propose(self, lookup, limit: int) -> list[int]:
        drafts = list(self.after.get(tuple(lookup.tokens), [])[:limit])
        self.calls += 1
        if drafts and self.calls % 3 == 0:
            drafts[-1] = (drafts[-1] + 1) % 300
        return drafts

    def finished(self, output) -> None:
        pass


def run(model_dir, requests, stages: int, mode: str, grammar: bool = False, max_draft: int = 4, drafter=None):
    batching = BatchingConfig(num_slots=4, num_micro_batches=2, max_step_tokens=16,
                              speculation=SpeculationConfig(mode=mode, max_draft=max_draft))
    scheduler = new_scheduler(model_dir, batching, stages, grammar=grammar)
    if drafter is not None:
        scheduler.speculation.drafter = drafter
    chain = InProcessChain(model_dir, SPANS[stages], num_slots=4)
    return drive(scheduler, chain, requests), scheduler.speculation.stats


def assert_same(off: dict, on: dict) -> None:
    assert sorted(off) == sorted(on)
    for request_id, expected in off.items():
        got = on[request_id]
        assert got.error is None and expected.error is None, (got.error, expected.error)
        assert got.token_ids == expected.token_ids, request_id
        assert (got.text, got.finish_reason, got.stop_text_end) == (expected.text, expected.finish_reason,
                                                                    expected.stop_text_end), request_id
        if expected.logprobs is not None:
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)
        if expected.top_logprobs is not None:
            assert [[i for i, _ in top] for top in got.top_logprobs] == [[i for i, _ in top]
                                                                        for top in expected.top_logprobs]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_drafting_changes_no_output(model_dir, stages):
    requests = requests_for(model_dir)
    off, off_stats = run(model_dir, requests, stages, "off")
    on, stats = run(model_dir, requests, stages, "ngram", drafter=KnowingDrafter(requests, off))
    assert off_stats.proposed == 0
    assert stats.accepted > 0 and stats.missed > 0, f"verification must both accept and reject here: {stats}"
    assert stats.tokens > 1.5 * stats.trips, stats
    assert_same(off, on)
    assert any(r.finish_reason == "length" for r in on.values()) and any(r.stop_text_end is not None
                                                                        for r in on.values())


@pytest.mark.parametrize("mode", ["suffix", "auto"])
def test_every_drafter_changes_no_output(model_dir, mode):
    requests = requests_for(model_dir)
    off, _ = run(model_dir, requests, 2, "off")
    on, stats = run(model_dir, requests, 2, mode)
    assert_same(off, on)


def test_constrained_decoding_advances_over_accepted_drafts_only(model_dir):
    requests, constraint_by_id = mixed_requests(model_dir, 12, max_new_tokens=32)
    off, _ = run(model_dir, requests, 2, "off", grammar=True)
    on, stats = run(model_dir, requests, 2, "ngram", grammar=True, drafter=KnowingDrafter(requests, off))
    assert stats.accepted > 0 and stats.missed > 0, stats
    assert_same(off, on)
    for request_id, result in on.items():
        if result.finish_reason == "stop":
            check_output(constraint_by_id[request_id], result.text)
