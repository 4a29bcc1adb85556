"""A large job's workload from an evenly spread sample of its items: the plan's sums (steps, prompt and
new tokens) are the whole job's, and the planner tokenizes no more than the sample."""

from __future__ import annotations

import random
from typing import Any

import pytest

from layerbus.planner.batching import BatchingConfig
from layerbus.planner.workload import Workload
from layerbus.broker.job_simulation import job_shape
from layerbus.jobs.item_params import item_params
from layerbus.jobs.job_workload import job_workload
from layerbus.storage import InvalidItem, JobSettings, JobStore, NewItem
from layerbus.planner.sample_places import sample_places
from tests.helpers.fixtures_jobs import tokenizer  # noqa: F401 - fixture
from tests.helpers.fixtures_stores import store, store_url  # noqa: F401 - fixtures

# "Within a few percent". For contrast: the sample's run scaled up as it is (no copies in job_shape) gives
# 17-31% more steps than the job's, and a sample at one fixed place per stretch (the middles) misses every
# long prompt of the cyclic job below.
TOLERANCE = 0.03
# A shuffled mix is sampled like a random draw: 600 items of prompts whose lengths vary about as much as
# their mean are off by ~CV / sqrt(600) = 4% at one standard deviation; 5% and more happen across seeds.
SHUFFLED_TOLERANCE = 0.08


def short() -> tuple[int, int]:
    return 50, 16


def long() -> tuple[int, int]:
    return 400, 48


def mixed_job(order: str, count: int = 6000) -> tuple[list[int], list[int]]:
    """Prompt lengths and budgets of a job of 70% short and 30% long items, in one of three orders:
    grouped (the short ones first, as inputs concatenated from two sources), cyclic (every 10th and
    every 4th item long: a period a sample of one in ten could fall in step with) or shuffled."""
    rng = random.Random(0)
    if order == "grouped":
        kinds = [short] * (count * 7 // 10) + [long] * (count - count * 7 // 10)
    elif order == "cyclic":
        kinds = [long if i % 10 == 9 or i % 4 == 3 else short for i in range(count)]
    else:
        kinds = rng.choices((short, long), weights=(7, 3), k=count)
    # some spread within each kind, so no two items are quite alike
    items = [(p + rng.randint(-20, 20), b + rng.choice((-8, 0, 8))) for p, b in (kind() for kind in kinds)]
    return [p for p, _ in items], [b for _, b in items]


def sums(workload: Workload, batching: BatchingConfig) -> dict[str, float]:
    shape = job_shape(workload, batching)
    total = shape.total
    return {"steps": total.steps, "prefill tokens": total.prefill_tokens, "decode rows": total.decode_rows,
            "decode context": total.decode_kv, "new tokens": shape.new_tokens}


def assert_close(sampled: dict[str, float], whole: dict[str, float], tolerance: float = TOLERANCE) -> None:
    off = {name: sampled[name] / whole[name] - 1 for name in whole}
    assert all(abs(x) <= tolerance for x in off.values()), f"sampled vs whole job: {off}"


@pytest.mark.parametrize("order, tolerance", [("grouped", TOLERANCE), ("cyclic", TOLERANCE),
                                              ("shuffled", SHUFFLED_TOLERANCE)])
def test_a_sample_of_a_mixed_job_gives_the_whole_jobs_sums(order: str, tolerance: float) -> None:
    prompts, budgets = mixed_job(order)
    whole = Workload.of(prompts, budgets, output_fraction=0.5)
    places = sample_places(600, len(prompts))
    sample = Workload.of([prompts[p] for p in places], [budgets[p] for p in places], 0.5, represents=len(prompts))
    batching = BatchingConfig(micro_batch_size=64, num_micro_batches=8).resolved(4)  # 512 slots: 1 per 12 items
    assert sample.items == whole.items == 6000 and sample.weight == 10
    assert_close(sums(sample, batching), sums(whole, batching), tolerance)
    assert sample.describe().startswith("6000 items (a sample of 600 of them), prompts ")
    expected = int(sample.describe().split("expected ")[1].split()[0])
    assert expected == pytest.approx(sum(whole.expected_lengths()), rel=tolerance)


def test_a_sample_is_told_where_the_whole_jobs_outputs_ended() -> None:
    sample = Workload.of([10, 20, 30], [8, 8, 8], represents=30)
    produced = sample.with_output_lengths(list(range(30)))  # one per item of the job, in the order they ran
    assert produced.output_lengths == (6, 12, 28) == tuple(sample_places(3, 30))  # those at the sample's places
    assert produced.items == 30
    with pytest.raises(ValueError, match="a sample of 3 items cannot stand for 2"):
        Workload.of([10, 20, 30], 8, represents=2)


class CountingTokenizer:
    """The tokenizer, counting the prompts it is asked to encode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.encoded = tokenizer, 0

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.encoded += 1
        return self.tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def queued_job(store: JobStore, count: int, task: str = "summarize") -> str:
    """A job of `count` items: documents of 5, then 20, then 120 words, budgets of 4, 8 and 16 tokens in
    turn, one item in 10 asking for 2 samples and one in 25 refused at submit; seqs are line numbers from 1."""
    rng = random.Random(1)
    words = "the report market growth region team quarter product customer revenue cost plan".split()
    items, refused = [], []
    for line in range(1, count + 1):
        if line % 25 == 0:
            refused.append(InvalidItem(f"bad-{line}", "{oops", "line is not JSON", line))
            continue
        overrides = {"max_tokens": (4, 8, 16)[line % 3]} | ({"n": 2} if line % 10 == 0 else {})
        text = " ".join(rng.choices(words, k=(5, 20, 120)[3 * (line - 1) // count]))
        items.append(NewItem(f"doc-{line}", text, text, item_params(overrides, add_special_tokens=False), line))
    return store.create_job(JobSettings(task=task, model="tiny", max_new_tokens=8), items, refused)


def test_job_workload_tokenizes_at_most_the_sample_and_stands_for_the_whole_job(store, tokenizer) -> None:
    job = queued_job(store, 3000)
    counting = CountingTokenizer(tokenizer)
    sampled = job_workload(store, job, counting, sample_items=300)
    assert counting.encoded <= 300
    whole = job_workload(store, job, tokenizer, sample_items=10**6)
    sequences = 3000 - 3000 // 25 + (3000 // 10 - 3000 // 50)  # refused left out; n = 2 counted twice
    assert whole.represents is None and whole.items == len(whole.prompt_lengths) == sequences
    assert sampled.items == pytest.approx(sequences, rel=0.01)
    batching = BatchingConfig(micro_batch_size=16, num_micro_batches=4).resolved(4)
    # Outputs ending at one share of their budgets: the sample's items are the job's in small
    half = [0.5]
    assert_close(sums(sampled.with_output_shares(half), batching), sums(whole.with_output_shares(half), batching))
    # Outputs assumed to end anywhere up to their budgets (nothing has run): the sample's items get the shares
    # their places get in the job, but which lengths meet which prompts in 300 items is then a draw
    assert sampled.output_shares_assumed and whole.output_shares_assumed
    assert_close(sums(sampled, batching), sums(whole, batching), SHUFFLED_TOLERANCE)


def test_a_job_no_larger_than_the_sample_is_read_whole(store, tokenizer) -> None:
    job = queued_job(store, 100)
    counting = CountingTokenizer(tokenizer)
    workload = job_workload(store, job, counting, sample_items=100)
    assert workload.represents is None and counting.encoded == 96  # the 4 refused items are not tokenized


def test_an_eval_job_is_read_whole_and_its_scoring_items_count_as_the_positions_they_feed(store, tokenizer) -> None:
    params = item_params({}, add_special_tokens=False)
    generation = [NewItem(f"g{i}", "x", "one two", params, seq=i) for i in range(200)]
    scoring = NewItem("s", "x", "three", {"score": [[[1, 2, 3], [[4], [5, 6]]]]}, seq=200)
    job = store.create_job(JobSettings(task="eval", model="tiny"), generation + [scoring])
    workload = job_workload(store, job, tokenizer, sample_items=10)  # a sample of 10 would miss the scoring item
    assert workload.represents is None and workload.items == 201
    # The context (3 tokens) once, then both continuations (1 and 2 tokens); nothing generated but the one
    # position the plan counts for every item.
    assert (workload.prompt_lengths[-1], workload.max_new_tokens[-1]) == (6, 1)


def test_a_job_with_nothing_completed_is_not_paged_through_for_where_outputs_end(store, tokenizer,
                                                                                 monkeypatch) -> None:
    job = queued_job(store, 100)
    read = []
    monkeypatch.setattr(store, "item_results", lambda job_id: read.append(job_id) or iter(()))
    assert job_workload(store, job, tokenizer).output_shares_assumed and read == []
