"""evals/lm_eval_items.py: lm-eval requests become layerbus score/generation items that compute exactly what
lm-eval's HF backend computes, and their outputs come back to the right request. Pure: no processes."""

from __future__ import annotations

import json
import random

import pytest

from layerbus.broker.scoring import phases_of
from layerbus.evals.encoding import model_input
from layerbus.evals.lm_eval_items import (
    PlannedItem,
    generation_params,
    job_name,
    plan_loglikelihood,
    plan_rolling,
    read_score_output,
    truncated_segment,
)
from layerbus.jobs.score_items import score_request


def fed_positions(context: tuple[int, ...], continuation: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The ids layerbus runs the model on for one segment, and the positions scored: from broker/scoring.py."""
    request = score_request("r", {"score": [[list(context), [list(continuation)]]]})
    phases = phases_of(request)
    ids = [token for phase in phases for token in phase.tokens]
    scored = list(range(phases[-1].start, phases[-1].start + len(phases[-1].tokens)))
    return ids, scored


@pytest.mark.parametrize("seed", range(20))
def test_a_segment_runs_the_ids_hflm_runs_and_scores_the_last_positions(seed):
    rng = random.Random(seed)
    max_length = rng.randint(1, 12)
    continuation = [rng.randrange(100) for _ in range(rng.randint(1, max_length))]
    context = [rng.randrange(100) for _ in range(rng.randint(1, 20))]
    segment_context, segment_continuation = truncated_segment(context, continuation, max_length)
    ids, scored = fed_positions(segment_context, segment_continuation)
    expected = model_input(context, continuation, max_length)  # HFLM's (ctx + cont)[-(L + 1):][:-1]
    assert ids == expected
    assert scored == list(range(len(expected) - len(continuation), len(expected)))
    assert segment_continuation == tuple(continuation) and len(ids) <= max_length


def test_a_continuation_longer_than_max_length_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="raise max_length"):
        truncated_segment([1], [2, 3, 4], max_length=2)
    with pytest.raises(ValueError, match="context and continuation"):
        truncated_segment([], [2], max_length=2)


def test_requests_with_one_truncated_context_share_an_item_and_map_back_in_order():
    requests = [([1, 2, 3], [7]), ([9], [5]), ([1, 2, 3], [8, 9]), ([1, 2, 3], [7]), ([9], [6])]
    plan = plan_loglikelihood(requests, max_length=16, texts=["q1", "q2", "q1", "q1", "q2"])
    assert [item.params for item in plan.items] == [{"score": [[[1, 2, 3], [[7], [8, 9], [7]]]]},
                                                  {"score": [[[9], [[5], [6]]]]}]
    assert [item.input for item in plan.items] == ["q1", "q2"]
    assert plan.answers == ((0, 0), (1, 0), (0, 1), (0, 2), (1, 1))


def test_truncation_can_split_the_choices_of_one_context():
    """Under truncation the kept context depends on the continuation's length, as in HFLM."""
    plan = plan_loglikelihood([([1, 2, 3, 4], [5]), ([1, 2, 3, 4], [6, 7])], max_length=4)
    assert [item.params["score"][0][0] for item in plan.items] == [[1, 2, 3, 4], [2, 3, 4]]
    assert plan.answers == ((0, 0), (1, 0))


def test_rolling_documents_are_one_item_each_and_empty_texts_have_none():
    windows = [([0], [1, 2, 3]), ([1, 2, 3], [4, 5])]
    plan = plan_rolling([windows, [], [([0], [9])]], max_length=3, texts=["a", "", "b"])
    assert plan.documents == (0, None, 1)
    assert plan.items[0].params == {"score": [[[0], [[1, 2, 3]]], [[2, 3], [[4, 5]]]]}  # [1] cut, as HFLM would
    assert plan.items[1].params == {"score": [[[0], [[9]]]]}


def test_generation_items_are_greedy_and_drop_empty_stop_strings():
    assert generation_params([4, 5], 8, ["\n", "", "<|eos|>"]) == {
        "prompt_ids": [4, 5], "max_tokens": 8, "stop": ["\n", "<|eos|>"], "temperature": 0}
    with pytest.raises(ValueError, match="no ids"):
        generation_params([], 8, [])


def test_the_job_name_is_a_digest_of_model_kind_numerics_and_items():
    items = (PlannedItem({"score": [[[1], [[2]]]]}, "a"), PlannedItem({"score": [[[3], [[4]]]]}, "b"))
    model, numerics = {"weights": {"model.safetensors": "ab"}}, {"wire": "float32"}
    name = job_name(model, "loglikelihood", numerics, items)
    assert name.startswith("lm-eval-") and len(name) == len("lm-eval-") + 64
    assert job_name(model, "loglikelihood", numerics, [PlannedItem(i.params, "other text") for i in items]) == name
    assert job_name({"weights": {"model.safetensors": "cd"}}, "loglikelihood", numerics, items) != name
    assert job_name(model, "loglikelihood_rolling", numerics, items) != name
    assert job_name(model, "loglikelihood", {"wire": "int8"}, items) != name
    assert job_name(model, "loglikelihood", numerics, items[::-1]) != name


def test_score_outputs_are_read_and_a_bad_one_names_its_item():
    output = json.dumps({"ll": [-1.5, -0.25], "is_greedy": [False, True], "tokens": [2, 1]})
    read = read_score_output("3", output)
    assert read.ll == (-1.5, -0.25) and read.is_greedy == (False, True)
    for bad in (None, "not json", json.dumps({"ll": [1.0]}), json.dumps({"ll": [1.0], "is_greedy": []})):
        with pytest.raises(ValueError, match="item 3"):
            read_score_output("3", bad)
