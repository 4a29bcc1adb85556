"""`n` samples per item: refused at submit when out of range, seeded by a pure function of (seed, custom_id,
sample index), each sample its own sequence, recorded when all are done, one result row each, and n choices
in the OpenAI output. tests/cluster/test_samples.py runs them through real stages."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.jobs.inputs import read_inputs
from layerbus.jobs.item_params import item_params
from layerbus.jobs.openai_output import OutputJob, join_by_seq, write_openai_files
from layerbus.jobs.runner import StoreSink, StoreSource, _hand_back, run_job
from layerbus.jobs.samples import parse_request_id, sample_request_id, sample_seed
from layerbus.storage import JobSettings, JobStore, NewItem
from layerbus.storage.result_row import RESULT_FIELDS
from layerbus.storage.results import ResultWriter, read_results
from tests.helpers.fixtures_jobs import store, tokenizer  # noqa: F401 - fixtures

# ---- seeds and ids ------------------------------------------------------------------------------------------

# (seed, custom_id, index) -> the sample's seed. Fixed values: a change here changes every sampled job's outputs.
SEED_TABLE = [
    ((0, "a", 0), 0),
    ((7, "a", 0), 7),  # sample 0 keeps the item's seed: n=1 and sample 0 sample as before `n` existed
    ((0, "a", 1), 5401172716285021346),
    ((0, "a", 2), 7746077858792324540),
    ((0, "b", 1), 3180725355835168838),
    ((1, "a", 1), 5078387470705568965),
    ((12345, "doc-7", 3), 324289119154230136),
    ((2**63 - 1, "x", 127), 7831482067620292838),
]


@pytest.mark.parametrize(("given", "seed"), SEED_TABLE)
def test_sample_seed_table(given, seed):
    assert sample_seed(*given) == seed
    assert 0 <= seed < 2**63


def test_sample_seeds_differ_across_samples_items_and_seeds():
    seeds = {sample_seed(s, c, i) for s in (0, 1, 99) for c in ("a", "b", "doc-1") for i in range(1, 129)}
    assert len(seeds) == 3 * 3 * 128


def test_request_ids_name_the_item_and_the_sample():
    assert sample_request_id(17, 0, 1) == "17", "an item of one sample keeps its id as its request id"
    assert [sample_request_id(17, i, 3) for i in range(3)] == ["17/0", "17/1", "17/2"]
    assert [parse_request_id(r) for r in ("17", "17/0", "17/2")] == [(17, 0), (17, 0), (17, 2)]


# ---- refused at submit -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "content", "line", "value"), [
    ("in.jsonl", '{"id": "a", "text": "doc"}\n{"id": "b", "text": "doc", "n": 0}\n', 2, "0"),
    ("in.jsonl", '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                 '"body": {"messages": [{"role": "user", "content": "hi"}], "n": 129}}\n', 1, "129"),
    ("in.jsonl", '{"id": "a", "text": "doc", "n": 2.5}\n', 1, "2.5"),
    ("in.jsonl", '{"id": "a", "text": "doc", "n": "4"}\n', 1, "'4'"),
    ("in.csv", "id,text,n\na,doc,3\nb,doc,200\n", 3, "200"),
])
def test_n_out_of_range_is_refused_at_submit_with_its_line_and_value(tmp_path, name, content, line, value):
    path = tmp_path / name
    path.write_text(content)
    result = read_inputs(path, "summarize")
    (problem,) = result.problems
    assert (problem.source, problem.line) == (str(path), line)
    assert "n must be an integer from 1 to 128" in problem.message and f"got {value}" in problem.message


def test_n_is_kept_in_the_items_params(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("id,text,n\na,doc,3\nb,doc,\n")
    records = read_inputs(path, "summarize").records
    assert [r.params for r in records] == [{"n": 3}, {}]


def test_submit_refuses_a_job_n_out_of_range_before_reading_anything(tmp_path, capsys, monkeypatch):
    from layerbus.cli.main import main

    monkeypatch.setenv("LAYERBUS_HOME", str(tmp_path))
    for value in ("0", "129", "two"):
        with pytest.raises(SystemExit) as exited:
            main(["submit", str(tmp_path / "missing.jsonl"), "--task", "summarize", "--n", value])
        assert exited.value.code == 2
        assert "--n" in capsys.readouterr().err


# ---- the job runner: samples out, items in ------------------------------------------------------------------

def queue(store: JobStore, params: list[dict], **settings) -> str:
    job = JobSettings(task="generate", model="tiny", max_new_tokens=4, temperature=0.8, **settings)
    items = [NewItem(f"doc-{i}", f"input {i}", f"The stage runs item {i}.", item_params(p, add_special_tokens=True),
                     seq=i + 1) for i, p in enumerate(params)]
    return store.create_job(job, items)


def answer(request: GenerationRequest, tokenizer) -> GenerationResult:
    """A result whose text names the request, its seed and its sample: what the sink must keep apart."""
    text = f"{request.request_id} seed {request.sampling.seed}"
    return GenerationResult(request.request_id, token_ids=tokenizer.encode(text, add_special_tokens=False), text=text,
                            finish_reason="length", prompt_tokens=len(request.prompt_ids), latency_s=0.5)


def test_each_sample_is_its_own_request_and_sample_0_is_the_item_as_before(store, tokenizer):
    job_id = queue(store, [{"n": 3}, {}, {"n": 2, "seed": 11}])
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w")
    requests = source.fetch(4)
    assert [r.request_id for r in requests][:3] == [f"{requests[0].request_id.split('/')[0]}/{i}" for i in range(3)]
    requests += source.fetch(10)
    assert len(requests) == 6 and source.fetch(10) == [] and source.exhausted
    by_item = {}
    for request in requests:
        by_item.setdefault(parse_request_id(request.request_id)[0], []).append(request)
    for item_id, item in source.outstanding.items():
        before = source.request_for(item)  # what an item gave before `n`: its one request
        samples = by_item[item_id]
        assert samples[0].prompt_ids == before.prompt_ids and samples[0].sampling == before.sampling
        assert [s.sampling.seed for s in samples] == [sample_seed(before.sampling.seed, item.custom_id, i)
                                                       for i in range(len(samples))]
        if len(samples) == 1:
            assert samples[0] == before, "an item of one sample is exactly the request it was before `n`"
    assert by_item[max(by_item)][0].sampling.seed == 11, "an item's own seed is its sample 0's"


def test_the_job_n_applies_where_the_item_gives_none(store, tokenizer):
    job_id = queue(store, [{}, {"n": 1}], extra={"n": 4})
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w")
    assert len(source.fetch(100)) == 5


def test_a_fetch_claims_items_for_the_samples_it_is_asked_for(store, tokenizer):
    job_id = queue(store, [{"n": 4}] * 10, extra={"n": 4})
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w")
    assert len(source.fetch(8)) == 8 and len(source.outstanding) == 2, "2 items of 4 samples"
    other = queue(store, [{"n": 4}] * 10)  # items' own n: the first claim takes one item per sample asked
    source = StoreSource(store, other, tokenizer, store.job_settings(other), "w")
    assert len(source.fetch(2)) == 2 and len(source.outstanding) == 2
    source.fetch(6)
    source.fetch(8)  # 8 samples asked, none left unsent: at 4 samples per item, 2 more items
    assert len(source.outstanding) == 4


def test_an_item_is_recorded_once_all_its_samples_are_in_one_row_each(store, tokenizer, tmp_path):
    job_id = queue(store, [{"n": 3}, {}])
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w")
    requests = source.fetch(10)
    writer = ResultWriter(tmp_path, job_id)
    sink = StoreSink(store, writer, source.outstanding, flush_every=100)
    results = [answer(r, tokenizer) for r in requests]
    sink.deliver([results[2], results[0], results[3]])  # out of order; item doc-0 still lacks sample 1
    sink.flush()
    assert store.job_status(job_id).completed == 1, "an item is done only when all its samples are"
    sink.deliver([results[1], results[1]])  # a late duplicate of a sample is harmless
    sink.flush()
    status = store.job_status(job_id)
    assert (status.completed, status.in_progress) == (2, 0)
    rows = list(store.item_results(job_id))
    assert [(r["custom_id"], r["sample_index"]) for r in rows] == [("doc-0", 0), ("doc-0", 1), ("doc-0", 2),
                                                                    ("doc-1", 0)]
    assert [r["output"] for r in rows[:3]] == [results[i].text for i in range(3)]
    assert [r["completion_tokens"] for r in rows] == [len(results[i].token_ids) for i in range(4)]
    assert status.completion_tokens == sum(len(r.token_ids) for r in results), "status counts every sample's tokens"
    parts = [row for part in writer.part_paths() for row in read_results(part).to_pylist()]
    assert sorted(parts, key=lambda r: (r["seq"], r["sample_index"])) == rows, "the parts hold the same rows"
    final = read_results(writer.finalize({}, store.item_results(job_id))).to_pylist()
    assert final == rows


def test_a_run_that_ends_mid_item_hands_the_whole_item_back(store, tokenizer, tmp_path):
    job_id = queue(store, [{"n": 3}])
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w")
    requests = source.fetch(2)  # the third sample not even handed to the broker yet
    sink = StoreSink(store, ResultWriter(tmp_path, job_id), source.outstanding)
    sink.deliver([answer(r, tokenizer) for r in requests])
    _hand_back(store, sink, source)
    status = store.job_status(job_id)
    assert (status.queued, status.completed) == (1, 0) and list(store.item_results(job_id)) == []
    again = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w2").fetch(10)
    assert [r.sampling for r in again[:2]] == [r.sampling for r in requests], "the rerun draws the same samples"


class DyingBroker:
    """Plays Broker.run over a job of sampled items, `batch` requests a step, committing after each step; in
    round `die_in` it delivers half the step's samples and dies as `kill -9` would: nothing flushed, nothing
    handed back."""

    def __init__(self, tokenizer, store: JobStore, batch: int, die_in: int | None = None):
        self._tokenizer, self.store, self.batch, self.die_in = tokenizer, store, batch, die_in

    def tokenizer(self):
        return self._tokenizer

    def run(self, source, sink, should_stop, events=None):
        step = 0
        while not source.exhausted and not should_stop():
            requests = source.fetch(self.batch)
            # The text depends on the sample's seed alone: equal across runs exactly when the seeds are.
            results = [GenerationResult(r.request_id, [5, 6], "length", len(r.prompt_ids),
                                        text=f"seed {r.sampling.seed}") for r in requests]
            if step == self.die_in:
                sink.deliver(results[: len(results) // 2])

                def dead(*args, **kwargs):
                    raise SystemExit("killed")

                self.store.complete_items = self.store.requeue_items = self.store.requeue_expired = dead
                raise SystemExit("killed")
            sink.deliver(results)
            sink.flush()
            step += 1


def test_a_broker_killed_mid_item_then_resumed_records_every_sample_once(tokenizer, tmp_path):
    rows = {}
    for name, die_in in (("clean", None), ("killed", 2)):
        with JobStore.open(f"sqlite:///{tmp_path / name}.db") as store:
            job_id = queue(store, [{"n": 3}] * 5)
            if die_in is not None:
                with pytest.raises(SystemExit):
                    run_job(store, job_id, DyingBroker(tokenizer, store, 4, die_in), tmp_path / name, poll_cancel_s=0)
                # the dead process's store is gone; a new one opens
                del store.complete_items, store.requeue_items, store.requeue_expired
                status = store.job_status(job_id)
                # The first fetch claimed 4 items (the job has no n; their 12 samples then served 3 steps): 2
                # done, item 2 finished but not committed, item 3 half-sampled, item 4 never claimed.
                assert (status.completed, status.in_progress, status.queued) == (2, 2, 1), "killed mid-item"
            status = run_job(store, job_id, DyingBroker(tokenizer, store, 4), tmp_path / name, poll_cancel_s=0)
            assert (status.status, status.completed) == ("completed", 5)
            rows[name] = read_results(Path(status.results_path)).to_pylist()
    assert [(r["custom_id"], r["sample_index"]) for r in rows["killed"]] == [
        (f"doc-{i}", k) for i in range(5) for k in range(3)], "every sample once"
    assert [r["output"] for r in rows["killed"]] == [r["output"] for r in rows["clean"]]
    assert len({r["output"] for r in rows["clean"]}) == 15


def test_the_openai_output_has_n_choices_and_usage_over_every_sample(store, tokenizer, tmp_path):
    job_id = queue(store, [{"n": 3}, {}])
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "w")
    requests = source.fetch(10)
    sink = StoreSink(store, ResultWriter(tmp_path, job_id), source.outstanding)
    sink.deliver([answer(r, tokenizer) for r in requests])
    sink.flush()
    out = tmp_path / "out.jsonl"
    with out.open("w") as handle:
        counts = write_openai_files(OutputJob(job_id, "tiny", 0),
                                    join_by_seq(store.item_results(job_id), store.job_items(job_id)), handle, None)
    assert (counts.output, counts.errors) == (2, 0)
    first, second = [json.loads(line)["response"]["body"] for line in out.read_text().splitlines()]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2] and len(second["choices"]) == 1
    assert [c["message"]["content"] for c in first["choices"]] == [answer(r, tokenizer).text for r in requests[:3]]
    completion = sum(len(answer(r, tokenizer).token_ids) for r in requests[:3])
    prompt = len(requests[0].prompt_ids)
    assert first["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}, "the prompt once, every sample's completion"


def test_parts_written_before_sample_index_are_read_as_sample_0(tmp_path):
    writer = ResultWriter(tmp_path, "job_1")
    old_fields = [(name, pa.type_for_alias(kind)) for name, kind in RESULT_FIELDS if name != "sample_index"]
    old = pa.Table.from_pylist([{"custom_id": "a", "seq": 1, "output": "old", "status": "completed"}],
                               schema=pa.schema(old_fields))
    writer.parts_dir.mkdir(parents=True)
    pq.write_table(old, writer.parts_dir / "part-00001.parquet")
    writer._next_part = 2
    writer.write_part([{"custom_id": "b", "seq": 2, "output": f"b{i}", "status": "completed", "sample_index": i}
                       for i in range(2)])
    rows = read_results(writer.finalize({})).to_pylist()
    assert [(r["custom_id"], r["sample_index"], r["output"]) for r in rows] == [("a", 0, "old"), ("b", 0, "b0"),
                                                                                ("b", 1, "b1")]


# ---- through real stage processes -----------------------------------------------------------------------------
