"""run_job, StoreSource and StoreSink against a real SQLite store and a real tokenizer, with the broker
played in-process by a script: requests out of claimed items, results into parts and the store, exactly
one row per custom_id after a kill between part and commit, cancel, failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerbus.jobs.item_params import ADD_SPECIAL_TOKENS_KEY, item_params
from layerbus.jobs.runner import StoreSink, StoreSource, item_seed, run_job
from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.storage import JobSettings, NewItem
from layerbus.storage.results import ResultWriter, read_results, results_metadata
from tests.helpers.fixtures_jobs import store, tokenizer  # noqa: F401 - fixtures
from tests.helpers.scripted_broker import FailingBroker, ScriptedBroker, final_rows, queue_job


def test_run_job_records_every_item_once_with_metadata(store, tokenizer, tmp_path):
    job_id = queue_job(store, 10, invalid=1)
    broker = ScriptedBroker(tokenizer, batch=3)

    status = run_job(store, job_id, broker, tmp_path / "results", poll_cancel_s=0)

    assert status.status == "completed"
    assert (status.total, status.completed, status.failed, status.queued, status.in_progress) == (11, 10, 1, 0, 0)
    rows = final_rows(status.results_path)
    assert [r["custom_id"] for r in rows] == [f"doc-{i}" for i in range(10)] + ["bad-0"]
    first = rows[0]
    assert first["input"] == "input 0" and first["status"] == "completed" and first["finish_reason"] == "length"
    prompt_ids = tokenizer.encode("The stage runs item 0.")
    assert first["output"] == tokenizer.decode(prompt_ids[:4], skip_special_tokens=True)
    assert (first["prompt_tokens"], first["completion_tokens"]) == (len(prompt_ids), 4)
    assert rows[-1]["status"] == "failed" and rows[-1]["error"] == "line is not JSON"
    assert sum(r["completion_tokens"] or 0 for r in rows) == status.completion_tokens
    metadata = results_metadata(Path(status.results_path))
    assert (metadata["job_id"], metadata["model"]) == (job_id, "tiny")
    assert '"max_new_tokens": 4' in metadata["settings"]
    assert not (tmp_path / "results" / job_id).exists(), "parts are deleted once the final file is written"


def test_claims_only_what_is_fetched(store, tokenizer):
    job_id = queue_job(store, 10)
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w1")
    assert len(source.fetch(3)) == 3
    assert store.job_status(job_id).in_progress == 3
    assert len(source.fetch(100)) == 7 and not source.exhausted
    assert source.fetch(5) == [] and source.exhausted


def test_item_params_override_job_settings(store, tokenizer):
    settings = JobSettings(task="generate", model="tiny", max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=40,
                           seed=3, extra={"stop": ["END"]})
    job_id = queue_job(store, 3, settings, overrides={1: {"max_tokens": 2, "temperature": 0.0, "seed": 9,
                                                          "stop": ["x", "y"], "top_k": 5}})
    requests = StoreSource(store, job_id, tokenizer, settings, "w1").fetch(3)
    default, overridden, other = requests
    assert default.max_new_tokens == 5 and default.stop == ("END",)
    assert (default.sampling.temperature, default.sampling.top_p, default.sampling.top_k) == (0.7, 0.9, 40)
    assert default.sampling.seed == item_seed(3, 1)
    assert other.sampling.seed == item_seed(3, 3) != default.sampling.seed, "items sample differently"
    assert overridden.max_new_tokens == 2 and overridden.stop == ("x", "y")
    assert (overridden.sampling.temperature, overridden.sampling.top_k, overridden.sampling.seed) == (0.0, 5, 9)
    assert default.prompt_ids == tokenizer.encode("The stage runs item 0.")
    assert default.request_id.isdigit(), "request ids are item ids, so results find their item"


def test_default_seed_is_reproducible_across_runs():
    assert item_seed(0, 7) == item_seed(0, 7)
    assert len({item_seed(seed, seq) for seed in range(3) for seq in range(50)}) == 150
    assert all(0 <= item_seed(2**63 - 1, seq) < 2**63 for seq in range(10))


class RecordingTokenizer:
    def __init__(self, inner):
        self.inner, self.flags = inner, []
        self.bos_token = inner.bos_token

    def encode(self, text, add_special_tokens=True, **kwargs):
        self.flags.append(add_special_tokens)
        return self.inner.encode(text, add_special_tokens=add_special_tokens, **kwargs)


def test_prompts_are_tokenized_as_rendered(store, tokenizer):
    items = [NewItem("chat", "hi", "<|bos|><|user|>\nhi", item_params({}, False), 1),
             NewItem("raw", "hi", "hi", item_params({}, True), 2),
             NewItem("other-tool", "hi", "<|bos|>hi", {}, 3)]  # queued without the key: BOS means a template
    job_id = store.create_job(JobSettings(task="generate", model="tiny"), items)
    recording = RecordingTokenizer(tokenizer)
    StoreSource(store, job_id, recording, store.job_settings(job_id), "w1").fetch(3)
    assert recording.flags == [False, True, False]
    assert ADD_SPECIAL_TOKENS_KEY in items[0].params


def test_seq_comes_from_the_column_and_is_not_stored_in_params(store, tokenizer, tmp_path):
    job_id = queue_job(store, 2)
    claimed = store.claim_items(job_id, "w1", 2)
    assert [(item.custom_id, item.seq) for item in claimed] == [("doc-0", 1), ("doc-1", 2)]
    assert all("seq" not in item.params for item in claimed)


def test_a_store_with_seq_in_params_still_runs_the_same(store, tokenizer, tmp_path):
    # Stores made before ClaimedItem.seq have the position in params too; it must change nothing.
    settings = JobSettings(task="generate", model="tiny", max_new_tokens=4, seed=5)
    items = [NewItem(f"doc-{i}", f"input {i}", f"The stage runs item {i}.", {**item_params({}, True), "seq": i + 1},
                     seq=i + 1) for i in range(3)]
    job_id = store.create_job(settings, items)
    requests = StoreSource(store, job_id, tokenizer, settings, "w1").fetch(3)
    assert [r.sampling.seed for r in requests] == [item_seed(5, seq) for seq in (1, 2, 3)]
    store.requeue_in_flight(job_id)
    status = run_job(store, job_id, ScriptedBroker(tokenizer, batch=2), tmp_path, poll_cancel_s=0)
    assert [(r["custom_id"], r["seq"]) for r in final_rows(status.results_path)] == [
        ("doc-0", 1), ("doc-1", 2), ("doc-2", 3)]


def test_sink_records_the_results_text_and_one_row_in_part_and_store(store, tokenizer, tmp_path):
    job_id = queue_job(store, 3)
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w1")
    first, second, third = source.fetch(3)
    writer = ResultWriter(tmp_path, job_id)
    sink = StoreSink(store, writer, source.outstanding, flush_every=100)
    words = tokenizer.encode("one two three")
    sink.deliver([GenerationResult(first.request_id, words + [tokenizer.eos_token_id], "stop", 5, text="one two three"),
                  GenerationResult(second.request_id, words, "stop", 5, stop_text_end=4, text="one "),
                  GenerationResult(third.request_id, [], "error", 5, error="too long")])
    assert store.job_status(job_id).completed == 0, "nothing is committed before the flush"
    sink.flush()
    stored = list(store.item_results(job_id))
    assert {row["custom_id"]: row["output"] for row in stored} == {"doc-0": "one two three", "doc-1": "one ",
                                                                    "doc-2": None}
    (part,) = writer.part_paths()
    assert read_results(part).to_pylist() == stored, "the part and the store hold the same result rows"
    assert source.outstanding == {}


def test_sink_refuses_tokens_without_text(store, tokenizer, tmp_path):
    job_id = queue_job(store, 1)
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w1")
    (request,) = source.fetch(1)
    sink = StoreSink(store, ResultWriter(tmp_path, job_id), source.outstanding)
    with pytest.raises(ValueError, match="no text"):
        sink.deliver([GenerationResult(request.request_id, [5, 6], "length", 5)])


def test_killed_between_part_and_commit_gives_each_custom_id_once(store, tokenizer, tmp_path, monkeypatch):
    job_id = queue_job(store, 8)

    def killed(*args, **kwargs):
        raise SystemExit("killed")  # the process dies here: no requeue, nothing committed

    with monkeypatch.context() as patch:
        patch.setattr(store, "complete_items", killed)
        patch.setattr(store, "requeue_items", killed)
        real_requeue_expired = store.requeue_expired

        def requeue_expired(job_id, *args, holders=(), **kwargs):  # a run's end hands its own items back so
            return killed() if holders else real_requeue_expired(job_id, *args, **kwargs)

        patch.setattr(store, "requeue_expired", requeue_expired)
        with pytest.raises(SystemExit):
            run_job(store, job_id, ScriptedBroker(tokenizer, batch=8), tmp_path, poll_cancel_s=0)
    parts = ResultWriter(tmp_path, job_id).part_paths()
    assert len(parts) == 1 and read_results(parts[0]).num_rows == 8, "the part was written before the kill"
    assert store.job_status(job_id).in_progress == 8, "the store never heard of those results"

    status = run_job(store, job_id, ScriptedBroker(tokenizer, batch=8), tmp_path, poll_cancel_s=0)

    assert status.status == "completed" and status.completed == 8
    rows = final_rows(status.results_path)
    assert sorted(r["custom_id"] for r in rows) == [f"doc-{i}" for i in range(8)]
    assert all(r["status"] == "completed" for r in rows)


def test_cancel_keeps_finished_outputs_and_cancels_the_rest(store, tokenizer, tmp_path):
    job_id = queue_job(store, 12)

    def cancel_in_second_round(round_number, requests):
        if round_number == 1:
            assert store.cancel_job(job_id) == "cancelling"  # another process runs `layerbus cancel`

    broker = ScriptedBroker(tokenizer, batch=4, before_deliver=cancel_in_second_round, deliver_only=1)
    status = run_job(store, job_id, broker, tmp_path, poll_cancel_s=0)

    assert status.status == "cancelled"
    assert (status.completed, status.cancelled, status.queued, status.in_progress) == (2, 10, 0, 0)
    rows = final_rows(status.results_path)
    assert len(rows) == 12 and len({r["custom_id"] for r in rows}) == 12
    assert [r["status"] for r in rows].count("completed") == 2
    assert {r["custom_id"] for r in rows if r["status"] == "completed"} == {"doc-0", "doc-4"}


def test_a_crash_fails_the_job_and_keeps_finished_outputs(store, tokenizer, tmp_path):
    job_id = queue_job(store, 9)

    def crash_in_third_round(round_number, requests):
        if round_number == 2:
            raise RuntimeError("stage-1 exploded")

    broker = ScriptedBroker(tokenizer, batch=3, before_deliver=crash_in_third_round)
    status = run_job(store, job_id, broker, tmp_path, poll_cancel_s=0)

    assert status.status == "failed" and "stage-1 exploded" in status.error
    assert (status.completed, status.in_progress, status.queued) == (6, 0, 3), "claimed items went back"
    parts = ResultWriter(tmp_path, job_id).part_paths()
    assert sum(read_results(p).num_rows for p in parts) == 6


def test_a_job_whose_items_all_failed_finishes_failed_and_says_so(store, tokenizer, tmp_path):
    # As kaapi-backend #723 found, OpenAI calls such a batch "completed"; here it must not look done.
    job_id = queue_job(store, 3)

    status = run_job(store, job_id, FailingBroker(tokenizer), tmp_path, poll_cancel_s=0)

    assert (status.status, status.failed, status.completed) == ("failed", 3, 0)
    assert "every item failed (3 of 3)" in status.error and status.timestamps["failed_at"] is not None
    assert status.results_path is not None, "the errors are still written out"
    assert all(r["error"] == "too long" and r["output"] is None for r in final_rows(status.results_path))


def test_a_job_with_items_refused_at_submit_and_the_rest_failed_finishes_failed(store, tokenizer, tmp_path):
    job_id = queue_job(store, 2, invalid=1)

    status = run_job(store, job_id, FailingBroker(tokenizer), tmp_path, poll_cancel_s=0)

    assert (status.status, status.failed, status.total) == ("failed", 3, 3)
    assert "every item failed (3 of 3)" in status.error


def test_a_job_with_some_failed_items_stays_completed(store, tokenizer, tmp_path):
    job_id = queue_job(store, 4)

    status = run_job(store, job_id, FailingBroker(tokenizer, failing={1}), tmp_path, poll_cancel_s=0)

    assert (status.status, status.failed, status.completed) == ("completed", 1, 3) and status.error is None


def test_finished_jobs_are_left_alone(store, tokenizer, tmp_path):
    job_id = queue_job(store, 2)
    first = run_job(store, job_id, ScriptedBroker(tokenizer), tmp_path, poll_cancel_s=0)
    broker = ScriptedBroker(tokenizer)
    again = run_job(store, job_id, broker, tmp_path, poll_cancel_s=0)
    assert again.status == "completed" and again.results_path == first.results_path and broker.requests == []


def test_a_job_stopped_while_finalizing_is_finalized_on_resume(store, tokenizer, tmp_path, monkeypatch):
    job_id = queue_job(store, 4)
    with monkeypatch.context() as patch:
        patch.setattr(ResultWriter, "finalize", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            run_job(store, job_id, ScriptedBroker(tokenizer), tmp_path, poll_cancel_s=0)
    assert store.job_status(job_id).status == "finalizing"

    broker = ScriptedBroker(tokenizer)
    status = run_job(store, job_id, broker, tmp_path, poll_cancel_s=0)

    assert status.status == "completed" and broker.requests == []
    assert sorted(r["custom_id"] for r in final_rows(status.results_path)) == [f"doc-{i}" for i in range(4)]


def test_recovery_events_of_a_run_are_recorded_in_the_store(store, tokenizer, tmp_path):
    job_id = queue_job(store, 2)

    class Chain:
        def __init__(self, text: str) -> None:
            self.chain = text

        def text(self) -> str:
            return self.chain

    class RecoveringBroker(ScriptedBroker):
        placement = Chain("stage-0 [0, 2) -> stage-1 [2, 4)")

        def run(self, source, sink, should_stop, events=None):
            events("stage_lost", "stage stage-1 lost: silent for 5.1 s (liveness window 5 s)", stage="stage-1")
            self.placement = Chain("stage-0 [0, 4)")
            events("recovered", "re-planned without stage-1 in 1.20 s", stage="stage-1", duration_s=1.2)
            return super().run(source, sink, should_stop, events)

    status = run_job(store, job_id, RecoveringBroker(tokenizer), tmp_path, poll_cancel_s=0)
    assert status.status == "completed"
    assert [(e.kind, e.duration_s) for e in store.job_events(job_id)] == [("stage_lost", None), ("recovered", 1.2)]
    (worker,) = store.job_workers(job_id)
    assert worker.chain == "stage-0 [0, 4)", "status shows the chain in use after the re-plan, not the first one"


def test_scoring_items_become_score_requests_and_their_scores_the_output(store, tokenizer, tmp_path):
    """An eval item's params carry its token ids: no tokenizing, and the output is the scores as JSON."""
    import json

    from layerbus.broker.requests import ContinuationScore, ScoreRequest, ScoreSegment

    items = [NewItem("mc/q1", "{}", "Question?", {"score": [[[5, 6, 7], [[8, 9], [10]]]]}, seq=1),
             NewItem("gen/q2", "{}", "Prompt", {"prompt_ids": [1, 2, 3], "max_tokens": 2, "stop": ["\n"]}, seq=2)]
    job_id = store.create_job(JobSettings(task="eval", model="tiny"), items)
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w1")
    scored, generated = source.fetch(2)
    assert isinstance(scored, ScoreRequest)
    assert scored.segments == (ScoreSegment((5, 6, 7), ((8, 9), (10,))),)
    assert isinstance(generated, GenerationRequest) and generated.prompt_ids == [1, 2, 3]
    assert (generated.max_new_tokens, generated.stop) == (2, ("\n",))
    sink = StoreSink(store, ResultWriter(tmp_path, job_id), source.outstanding)
    scores = [ContinuationScore((-1.0, -0.5), (True, False)), ContinuationScore((-0.25,), (True,))]
    sink.deliver([GenerationResult(scored.request_id, [], "stop", 4, scores=scores),
                  GenerationResult(generated.request_id, [7, 8], "length", 3, text="ok")])
    sink.flush()
    outputs = {row["custom_id"]: row["output"] for row in store.item_results(job_id)}
    assert json.loads(outputs["mc/q1"]) == {"ll": [-1.5, -0.25], "is_greedy": [False, True], "tokens": [2, 1]}
    assert outputs["gen/q2"] == "ok"


def test_a_malformed_score_item_is_refused_with_its_id(store, tokenizer):
    items = [NewItem("mc/bad", "{}", "Q", {"score": [[[5, 6], [[]]]]}, seq=1)]
    job_id = store.create_job(JobSettings(task="eval", model="tiny"), items)
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w1")
    with pytest.raises(ValueError, match=r"item \d+: .*at least one token"):
        source.fetch(1)


def test_an_interrupt_between_a_claims_commit_and_its_return_hands_those_items_back_too(store, tokenizer, tmp_path,
                                                                                          monkeypatch):
    """Ctrl-C can land after the store committed a claim but before claim_items returned it: the source never
    saw those items. They must go back to the queue now, not wait out this worker's lease."""
    job_id = queue_job(store, 10)
    real_claim = store.claim_items
    calls = []

    def claim_then_interrupted(*args, **kwargs):
        claimed = real_claim(*args, **kwargs)  # committed: the store lists them under this worker
        calls.append(len(claimed))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return claimed

    with monkeypatch.context() as patch:
        patch.setattr(store, "claim_items", claim_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_job(store, job_id, ScriptedBroker(tokenizer, batch=3, deliver_only=1), tmp_path, poll_cancel_s=0)
    assert calls == [3, 3]
    status = store.job_status(job_id)
    assert (status.completed, status.in_progress, status.queued) == (1, 0, 9), "every unfinished claim went back"
    assert store.job_leases(job_id) == []

    status = run_job(store, job_id, ScriptedBroker(tokenizer, batch=3), tmp_path, poll_cancel_s=0)
    assert status.status == "completed" and status.completed == 10
    assert sorted(r["custom_id"] for r in final_rows(status.results_path)) == sorted(f"doc-{i}" for i in range(10))
