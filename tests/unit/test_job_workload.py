"""A queued job's workload for the planner: prompts tokenized as the runner tokenizes them, each
item's own output budget, refused items left out, and no workload for scoring jobs."""

from __future__ import annotations

import pytest

from layerbus.planner.workload import ASSUMED_OUTPUT_SHARES
from layerbus.jobs.item_params import PROMPT_IDS_KEY, item_params
from layerbus.jobs.job_workload import job_workload
from layerbus.storage import InvalidItem, JobSettings, NewItem
from tests.helpers.fixtures_jobs import store, tokenizer  # noqa: F401 - fixtures


def test_prompt_lengths_and_budgets_come_from_the_items(store, tokenizer) -> None:
    prompts = ["one two three", "a much longer prompt than the first one, with more words in it"]
    items = [NewItem("a", "x", prompts[0], item_params({}, add_special_tokens=False), seq=1),
             NewItem("b", "y", prompts[1], item_params({"max_tokens": 7}, add_special_tokens=False), seq=2),
             NewItem("c", "z", "", {PROMPT_IDS_KEY: [5, 6, 7, 8, 9]}, seq=3)]
    job = store.create_job(JobSettings(task="generate", model="tiny", max_new_tokens=16), items,
                           [InvalidItem("bad", "{oops", "line is not JSON", seq=4)])
    workload = job_workload(store, job, tokenizer)
    assert workload.prompt_lengths == (len(tokenizer.encode(prompts[0], add_special_tokens=False)),
                                       len(tokenizer.encode(prompts[1], add_special_tokens=False)), 5)
    assert workload.max_new_tokens == (16, 7, 16)  # an item's max_tokens overrides the job's
    # Where outputs end at EOS is not known before any has run: assumed anywhere up to the budget, evenly
    assert workload.output_shares == ASSUMED_OUTPUT_SHARES and workload.output_shares_assumed
    assert "assumed spread evenly" in workload.describe()


def test_the_blocks_items_share_at_their_start_are_named_for_the_prefix_cache(store, tokenizer) -> None:
    shared = list(range(10, 42))  # two blocks of 16 tokens every item starts with
    items = [NewItem(f"i{k}", "x", "", {PROMPT_IDS_KEY: shared + [50 + k] * (5 + k)}, seq=k + 1) for k in range(3)]
    items.append(NewItem("own", "x", "", {PROMPT_IDS_KEY: [7] * 40}, seq=4))
    job = store.create_job(JobSettings(task="generate", model="tiny", max_new_tokens=4), items)
    workload = job_workload(store, job, tokenizer)
    assert workload.prefix_blocks == ((0, 1), (0, 1), (0, 1), ())


def test_a_scoring_item_counts_as_the_positions_it_feeds_and_one_new_token(store, tokenizer) -> None:
    scoring = {"score": [[[1, 2, 3], [[4], [5, 6]]]]}  # a context and two continuations
    generation = NewItem("g", "y", "one two", item_params({}, add_special_tokens=False), seq=2)
    job = store.create_job(JobSettings(task="generate", model="tiny"),
                           [NewItem("s", "x", "three", scoring, seq=1), generation])
    workload = job_workload(store, job, tokenizer)
    assert workload.items == 2
    assert (workload.prompt_lengths[0], workload.max_new_tokens[0]) == (6, 1)  # 3 + 1 + 2 positions fed
    assert workload.prompt_lengths[1] == len(tokenizer.encode("one two", add_special_tokens=False))


def test_outputs_are_expected_to_end_where_the_same_model_and_task_ended_before(store, tokenizer) -> None:
    from layerbus.storage import ItemResult

    settings = JobSettings(task="summarize", model="tiny", max_new_tokens=10)
    items = [NewItem(f"d{i}", "x", "one two", item_params({}, add_special_tokens=False), seq=i + 1) for i in range(10)]
    first = store.create_job(settings, items)
    assert job_workload(store, first, tokenizer).output_shares_assumed  # nothing has run yet
    claimed = store.claim_items(first, "w", 10)
    store.complete_items([ItemResult(item.item_id, output="out", finish_reason="stop", prompt_tokens=2,
                                     completion_tokens=4 if i % 2 else 2, latency_s=0.1)
                          for i, item in enumerate(claimed)])
    second = store.create_job(settings, items)
    workload = job_workload(store, second, tokenizer)
    assert workload.output_fraction == pytest.approx(30 / 100)
    # Not one mean for all: half the outputs ended at 2 tokens of 10, half at 4, and so will this job's.
    assert workload.output_shares == (0.2,) * 5 + (0.4,) * 5 and not workload.output_shares_assumed
    assert "as 10 earlier outputs ended" in workload.describe()
    assert sorted(workload.expected_lengths()) == [2] * 5 + [4] * 5
    other_task = store.create_job(JobSettings(task="translate", model="tiny", max_new_tokens=10), items)
    assert job_workload(store, other_task, tokenizer).output_shares == ASSUMED_OUTPUT_SHARES
