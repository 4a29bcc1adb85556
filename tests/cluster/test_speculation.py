"""Speculation on real stage processes over ZeroMQ: outputs identical with drafts on and off on 1-3 stages, and
after kill -9 of a stage mid-job (its re-plan and every sequence's re-prefill meet rows with drafts in flight).
The broker runs in this process, so its drafter is replaced by one that knows the run's outputs (a random tiny
model's outputs repeat nothing a real drafter could find): drafts are then accepted and rejected both."""

from __future__ import annotations

import pytest

import layerbus.broker.speculation as speculation_module
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.speculation import SpeculationConfig
from tests.helpers import faulted_runs
from tests.helpers.equivalence import run_pipeline
from tests.helpers.speculation_cases import KnowingDrafter, assert_same, requests_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama", num_hidden_layers=4)


def knowing(monkeypatch, requests, results) -> None:
    monkeypatch.setattr(speculation_module, "new_drafter", lambda *args: KnowingDrafter(requests, results))


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_real_stages_give_the_same_outputs_with_drafts(model_dir, monkeypatch, num_stages):
    requests = requests_for(model_dir)
    off, off_stats = run_pipeline(model_dir, num_stages, requests, num_slots=4, max_step_tokens=16)
    off = {r.request_id: r for r in off}
    assert off_stats.speculation is None
    knowing(monkeypatch, requests, off)
    on, stats = run_pipeline(model_dir, num_stages, requests, num_slots=4, max_step_tokens=16,
                             speculation=SpeculationConfig(mode="ngram"))
    assert_same(off, {r.request_id: r for r in on})
    figures = stats.speculation
    assert figures["accepted"] > 0 and figures["accepted"] < figures["proposed"], figures
    assert figures["tokens_per_trip"] > 1.5, figures


def test_a_stage_killed_mid_job_changes_no_output_with_drafts(model_dir, monkeypatch):
    requests = requests_for(model_dir)
    batching = BatchingConfig(num_slots=6, num_micro_batches=3, max_step_tokens=16)
    off, _ = faulted_runs.run(model_dir, requests, batching=batching)
    knowing(monkeypatch, requests, off)
    killed: list[str] = []
    on, stats = faulted_runs.run(model_dir, requests, on_result=faulted_runs.kill_middle_after(3, killed),
                                 batching=BatchingConfig(num_slots=6, num_micro_batches=3, max_step_tokens=16,
                                                         speculation=SpeculationConfig(mode="ngram")))
    assert killed and stats.recoveries, "the middle stage was killed and the run recovered"
    assert stats.speculation["accepted"] > 0
    assert_same(off, on)
