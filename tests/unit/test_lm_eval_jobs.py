"""evals/lm_eval_jobs.py without stage processes: which earlier job a call re-attaches to, and what it does with
failed items. The local run is replaced by a fake that completes the claimed items itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import layerbus.launch.local_run as local_run
from layerbus.evals.lm_eval_items import PlannedItem, job_name
from layerbus.evals.lm_eval_jobs import LayerbusEvalError, LocalPipeline, job_settings, new_items, run_items
from layerbus.storage import ItemResult, JobStore

ITEMS = [PlannedItem({"score": [[[1, 2], [[3], [4, 5]]]]}, "q0"), PlannedItem({"score": [[[6], [[7]]]]}, "q1"),
         PlannedItem({"score": [[[8], [[9]]]]}, "q2")]


def output(seq: int) -> str:
    return json.dumps({"ll": [-float(seq)], "is_greedy": [True], "tokens": [1]})


class FakeRun:
    """run_job_locally's stand-in: completes every queued item (failing those in `fail`), counts its calls."""

    def __init__(self, fail: frozenset[int] = frozenset()):
        self.fail, self.calls, self.computed = fail, 0, []

    def __call__(self, store: JobStore, job_id: str, config, options, results_dir: Path, progress: bool = True):
        self.calls += 1
        store.requeue_in_flight(job_id)
        claimed = store.claim_items(job_id, "fake", 100)
        self.computed += [item.seq for item in claimed]
        store.complete_items([ItemResult(item.item_id, None if item.seq in self.fail else output(item.seq),
                                         "error" if item.seq in self.fail else "stop", 1, 0, 0.0,
                                         error="step failed on stage-0" if item.seq in self.fail else None)
                              for item in claimed])
        store.set_job_status(job_id, "finalizing")
        store.set_job_status(job_id, "completed")
        return store.job_status(job_id)


@pytest.fixture
def pipeline(tmp_path) -> LocalPipeline:
    return LocalPipeline(model_dir=tmp_path / "model", db=f"sqlite:///{tmp_path / 'store.db'}",
                         model_identity={"weights": {"model.safetensors": "ab"}}, progress=False)


@pytest.fixture
def fake(monkeypatch) -> FakeRun:
    run = FakeRun()
    monkeypatch.setattr(local_run, "run_job_locally", run)
    return run


def test_outputs_come_back_in_item_order_and_a_completed_job_is_reused(pipeline, fake):
    first = run_items(pipeline, "loglikelihood", ITEMS)
    assert first.outputs == tuple(output(seq) for seq in range(3)) and not first.reused
    again = run_items(pipeline, "loglikelihood", ITEMS)
    assert again.job_id == first.job_id and again.reused and again.outputs == first.outputs
    assert fake.calls == 1
    with JobStore.open(pipeline.db) as store:
        status = store.job_status(first.job_id)
    assert (status.task, status.name) == ("lm-eval", job_name(pipeline.model_identity, "loglikelihood",
                                                              pipeline.numerics(), ITEMS))


def test_an_interrupted_job_computes_only_what_is_left(pipeline, fake):
    name = job_name(pipeline.model_identity, "loglikelihood", pipeline.numerics(), ITEMS)
    with JobStore.open(pipeline.db) as store:
        job_id = store.create_job(job_settings(pipeline, "loglikelihood", name), new_items(ITEMS))
        done, in_flight = store.claim_items(job_id, "killed", 2)
        store.complete_items([ItemResult(done.item_id, output(0), "stop", 1, 0, 0.0)])
    resumed = run_items(pipeline, "loglikelihood", ITEMS)
    assert resumed.job_id == job_id and not resumed.reused
    assert fake.computed == [1, 2]  # item 0 was kept, item 1 (in flight at the kill) and item 2 ran
    assert resumed.outputs == tuple(output(seq) for seq in range(3))


def test_failed_items_raise_with_their_errors_and_the_next_call_queues_a_fresh_job(pipeline, monkeypatch):
    monkeypatch.setattr(local_run, "run_job_locally", FakeRun(fail=frozenset({1})))
    with pytest.raises(LayerbusEvalError, match=r"1 of 3 item\(s\) failed[\s\S]*item 1: failed: step failed"):
        run_items(pipeline, "loglikelihood", ITEMS)
    retry = FakeRun()
    monkeypatch.setattr(local_run, "run_job_locally", retry)
    fresh = run_items(pipeline, "loglikelihood", ITEMS)
    assert retry.computed == [0, 1, 2] and fresh.outputs[1] == output(1)
    with JobStore.open(pipeline.db) as store:
        name = job_name(pipeline.model_identity, "loglikelihood", pipeline.numerics(), ITEMS)
        assert len(store.list_jobs()) == 2 and store.find_job_by_name(name) == fresh.job_id


def test_a_job_that_did_not_complete_raises_naming_it(pipeline, monkeypatch):
    def fails(store: JobStore, job_id: str, *args, **kwargs):
        store.set_job_status(job_id, "failed", error="ClusterError: every stage was lost")
        return store.job_status(job_id)

    monkeypatch.setattr(local_run, "run_job_locally", fails)
    with pytest.raises(LayerbusEvalError, match=r"job job_\w+ ended failed: ClusterError: every stage was lost; "
                                                r"`layerbus status job_\w+`"):
        run_items(pipeline, "loglikelihood", ITEMS)


def test_no_items_make_no_job(pipeline, fake):
    assert run_items(pipeline, "loglikelihood", []).outputs == ()
    assert fake.calls == 0
