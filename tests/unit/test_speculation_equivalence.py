"""Speculation on against off, through the real scheduler, step rows, packed forward steps and last-stage picks of
a tiny model in one process: the same tokens, text, finish reasons and log-probs, greedy and seeded sampling,
1-3 stages, stop strings, max_tokens, n samples of one prompt, and constrained decoding. The verification path
must be exercised both ways (drafts accepted and drafts rejected), or the comparison proves nothing."""

from __future__ import annotations

import pytest

from layerbus.planner.batching import BatchingConfig
from layerbus.planner.speculation import SpeculationConfig
from tests.helpers.constrained_items import check_output, mixed_requests
from tests.helpers.inprocess_chain import InProcessChain, drive, new_scheduler
from tests.helpers.speculation_cases import KnowingDrafter, assert_same, requests_for

SPANS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama", num_hidden_layers=4)


def run(model_dir, requests, stages: int, mode: str, grammar: bool = False, max_draft: int = 4, drafter=None):
    batching = BatchingConfig(num_slots=4, num_micro_batches=2, max_step_tokens=16,
                              speculation=SpeculationConfig(mode=mode, max_draft=max_draft))
    scheduler = new_scheduler(model_dir, batching, stages, grammar=grammar)
    if drafter is not None:
        scheduler.speculation.drafter = drafter
    chain = InProcessChain(model_dir, SPANS[stages], num_slots=4)
    return drive(scheduler, chain, requests), scheduler.speculation.stats


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
