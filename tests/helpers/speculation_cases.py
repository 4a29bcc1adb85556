"""The cases speculation is tested on, in one process and on real stages: requests that cover greedy and seeded
sampling (temperature, top-k, top-p), log-probs and top log-probs, stop strings, max_tokens and n samples of one
prompt; a drafter that knows a run's outputs; and the comparison of two runs' results."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from layerbus.broker.requests import GenerationRequest
from layerbus.jobs.samples import sample_seed
from layerbus.wire.sampling import SamplingParams
from tests.helpers.equivalence import TINY_PROMPTS

SAMPLED = [SamplingParams(), SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.0, top_k=5, seed=3),
           SamplingParams(temperature=0.7, top_p=0.9, seed=5)]


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
