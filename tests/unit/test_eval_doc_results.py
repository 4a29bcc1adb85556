"""Item outputs become per-document samples rows and task metrics equal to hand-computed ones.

Items are built by task_items with the tiny test tokenizer; the runtime's answers are written by hand (known
log-likelihoods), so every acc, acc_norm, exact_match, perplexity and bits-per-byte below is worked out here.
"""

from __future__ import annotations

import math
import re

import pytest

from layerbus.evals import metrics
from layerbus.evals.doc_results import (
    SAMPLE_COLUMNS,
    IncompleteTaskError,
    ItemOutcome,
    MetricValue,
    metric_items,
    outcomes_by_doc,
    read_samples,
    samples_rows,
    samples_schema,
    task_metrics,
    task_result,
    write_samples,
)
from layerbus.evals.documents import (
    GENERATION,
    LOGLIKELIHOOD,
    MULTIPLE_CHOICE,
    ROLLING,
    GenerationDoc,
    LoglikelihoodDoc,
    MultipleChoiceDoc,
    RollingDoc,
)
from layerbus.evals.items import task_items
from layerbus.evals.results_json import results_json
from layerbus.evals.task_yaml import FilterStep
from tests.helpers.eval_rows import ENCODER, loaded, rows_for

LN2 = math.log(2)


def value_of(values, metric, filter_name="none") -> MetricValue:
    (found,) = [v for v in values if v.metric == metric and v.filter == filter_name]
    return found


# --- multiple choice ------------------------------------------------------------------------------------------

MC = [
    # acc picks " a" (-3.0), wrong; acc_norm divides by characters: -4/9, -3/2, -6/8 -> " receives", right.
    MultipleChoiceDoc("1", "The stage", (" receives", " a", " the sea"), (0,), group="p"),
    # Both pick " the sea" (-1.0): right. Lengths without the delimiter: 8, 1, 7 -> -0.25, -2, -1/7.
    MultipleChoiceDoc("2", "The stage", ("receives", "a", "the sea"), (2,), group="p", target_delimiter=" "),
    # Both pick "a" (-0.4; per character -0.5, -0.4, -6/7): wrong.
    MultipleChoiceDoc("3", "The stage", ("receives", "a", "the sea"), (0, 2), target_delimiter=" "),
]
MC_LLS = {"1": [-4.0, -3.0, -6.0], "2": [-2.0, -2.0, -1.0], "3": [-4.0, -0.4, -6.0]}


def test_multiple_choice_rows_hand_computed():
    items, rows = rows_for(loaded(MULTIPLE_CHOICE, MC, ["acc", "acc_norm"]), MC_LLS)
    assert [(r["doc_id"], r["acc"], r["acc_norm"]) for r in rows] == [("1", 0.0, 1.0), ("2", 1.0, 1.0),
                                                                       ("3", 0.0, 0.0)]
    first = rows[0]
    assert list(first) == list(SAMPLE_COLUMNS)
    assert first["lls"] == [-4.0, -3.0, -6.0] and first["gold"] == [0] and rows[2]["gold"] == [0, 2]
    assert first["tokens"] == [4, 1, 3] and first["is_greedy"] == [False, False, False]
    assert (first["task"], first["kind"], first["filter"], first["group"], first["error"]) == \
        ("t", MULTIPLE_CHOICE, "none", "p", None)
    assert first["prompt_hash"] == items[0].params["prompt_hash"]
    assert first["exact_match"] is None and first["ll"] is None and first["generated"] is None


def test_multiple_choice_metrics_hand_computed():
    task = loaded(MULTIPLE_CHOICE, MC, ["acc", "acc_norm"])
    values = task_metrics(task, rows_for(task, MC_LLS)[1])
    acc, acc_norm = value_of(values, "acc"), value_of(values, "acc_norm")
    assert (acc.value, acc.n, acc_norm.value) == (pytest.approx(1 / 3), 3, pytest.approx(2 / 3))
    # Clustered (Miller 2024): docs 1 and 2 share passage "p". acc's residuals are -1/3, 2/3, -1/3: the unclustered
    # SE^2 is the sample variance (1/9 + 4/9 + 1/9) / 2 = 1/3 over n = 3, and the one within-cluster pair adds
    # 2 * (-1/3)(2/3) / n^2.
    unclustered_sq = (((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2) / 3
    assert acc.stderr == pytest.approx(math.sqrt(unclustered_sq + 2 * (-1 / 3) * (2 / 3) / 9))
    # acc_norm: 1, 1, 0; residuals 1/3, 1/3, -2/3; the pair in "p" adds 2 * (1/3)(1/3) / 9.
    assert acc_norm.stderr == pytest.approx(math.sqrt((((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2) / 3 + 2 / 81))


def test_choice_lls_follow_choice_order_across_several_segments():
    """max_length 4 gives " receives" a segment of its own between the others (test_eval_items): its ll must still
    land on it."""
    doc = MultipleChoiceDoc("1", "The stage", (" the sea", " receives", " spider"), (1,))
    items, rows = rows_for(loaded(MULTIPLE_CHOICE, [doc], ["acc"]), {"1": [-5.0, -1.0, -3.0]}, max_length=4)
    assert len(items[0].params["score"]) == 3
    assert (rows[0]["lls"], rows[0]["tokens"], rows[0]["acc"]) == ([-5.0, -1.0, -3.0], [3, 4, 3], 1.0)


def test_only_the_tasks_metrics_get_a_column():
    _, rows = rows_for(loaded(MULTIPLE_CHOICE, MC, ["acc_norm"]), MC_LLS)
    assert [r["acc"] for r in rows] == [None] * 3 and [r["acc_norm"] for r in rows] == [1.0, 1.0, 0.0]


# --- log-likelihood and rolling ----------------------------------------------------------------------------------


def test_loglikelihood_perplexity_and_greedy_acc_hand_computed():
    docs = [LoglikelihoodDoc("a", "The stage", " receives"), LoglikelihoodDoc("b", "The stage", " the sea")]
    task = loaded(LOGLIKELIHOOD, docs, ["perplexity", "acc"])
    _, rows = rows_for(task, {"a": ([-2.0], [True]), "b": ([-4.0], [False])})
    assert [(r["ll"], r["acc"], r["lls"], r["targets"]) for r in rows] == \
        [(-2.0, 1.0, [-2.0], [" receives"]), (-4.0, 0.0, [-4.0], [" the sea"])]
    values = task_metrics(task, rows, bootstrap_iters=1000)
    assert value_of(values, "perplexity").value == pytest.approx(math.exp(3.0))
    assert value_of(values, "acc").value == 0.5
    assert value_of(values, "acc").stderr == pytest.approx(0.5)  # sample std 0.707 / sqrt(2)
    assert value_of(values, "perplexity").stderr == metrics.stderr("perplexity", [-2.0, -4.0], [None, None], 1000)


ROLLING_DOCS = [RollingDoc("x", "The stage receives"), RollingDoc("y", "é")]  # 18 bytes 3 words; 2 bytes 1 word


def test_rolling_bits_per_byte_and_perplexities_hand_computed():
    task = loaded(ROLLING, ROLLING_DOCS, ["bits_per_byte", "byte_perplexity", "word_perplexity"])
    # max_length 4: "The stage receives" is scored in two windows, whose lls add up.
    _, rows = rows_for(task, {"x": ([-10.0, -4.0], [True, False]), "y": [-3.0]}, max_length=4)
    assert [(r["ll"], r["words"], r["bytes"], r["lls"], r["is_greedy"], r["tokens"]) for r in rows] == \
        [(-14.0, 3, 18, [-14.0], [False], [6]), (-3.0, 1, 2, [-3.0], [False], [2])]
    values = task_metrics(task, rows, bootstrap_iters=1000)
    assert value_of(values, "bits_per_byte").value == pytest.approx(17 / 20 / LN2)
    assert value_of(values, "byte_perplexity").value == pytest.approx(math.exp(17 / 20))
    assert value_of(values, "word_perplexity").value == pytest.approx(math.exp(17 / 4))
    assert metric_items(rows, "bits_per_byte") == [(-14.0, 18), (-3.0, 2)]
    assert metric_items(rows, "word_perplexity") == [(-14.0, 3), (-3.0, 1)]


def test_metric_items_refuses_a_metric_the_rows_do_not_carry():
    _, rows = rows_for(loaded(MULTIPLE_CHOICE, MC, ["acc"]), MC_LLS)
    with pytest.raises(ValueError, match="document '1' has no acc_norm for acc_norm"):
        metric_items(rows, "acc_norm")


# --- generation -----------------------------------------------------------------------------------------------

GEN = [
    GenerationDoc("1", "2+2?", None, ("4",), until=("\n\n",)),
    GenerationDoc("2", "3+3?", None, ("6", "six"), until=("\n\n",)),
]
STRICT = (FilterStep("regex", regex_pattern=r"answer is (\d+)"), FilterStep("take_first"))
LOOSE = (FilterStep("lowercase"), FilterStep("remove_whitespace"))


def test_generation_is_cut_at_the_stop_strings_and_scored_after_each_filter():
    task = loaded(GENERATION, GEN, ["exact_match"], filters={"strict": STRICT, "loose": LOOSE})
    _, rows = rows_for(task, {"1": "The answer is 4.\n\nQ: 5+5?", "2": " SIX <|eos|>junk"}, max_length=300)
    assert [(r["doc_id"], r["filter"], r["generated"], r["filtered"], r["exact_match"]) for r in rows] == [
        ("1", "strict", "The answer is 4.", "4", 1.0),
        ("1", "loose", "The answer is 4.", "the answer is 4.", 0.0),
        ("2", "strict", " SIX ", "[invalid]", 0.0),
        ("2", "loose", " SIX ", "six", 1.0),
    ]
    assert rows[2]["targets"] == ["6", "six"] and rows[0]["lls"] == []
    values = task_metrics(task, rows)
    assert [(v.metric, v.filter, v.value, v.n) for v in values] == [("exact_match", "strict", 0.5, 2),
                                                                    ("exact_match", "loose", 0.5, 2)]
    result = task_result(task, values)
    assert (result.filter_name, [f.filter_name for f in result.other_filters]) == ("strict", ["loose"])
    entry = results_json([result], {}, 0.0)["results"]["t"]
    assert entry["exact_match,strict"] == entry["exact_match,loose"] == 0.5


def test_exact_match_takes_the_metric_options_and_no_filter_list_means_none():
    task = loaded(GENERATION, GEN, ["exact_match"], options={"exact_match": {"ignore_case": True}})
    _, rows = rows_for(task, {"1": "4", "2": "SIX"}, max_length=300)
    assert [(r["filter"], r["filtered"], r["exact_match"]) for r in rows] == [("none", "4", 1.0),
                                                                            ("none", "SIX", 1.0)]
    plain = loaded(GENERATION, GEN, ["exact_match"])
    assert [r["exact_match"] for r in rows_for(plain, {"1": "4", "2": "SIX"}, max_length=300)[1]] == [1.0, 0.0]


# --- failures stay visible ----------------------------------------------------------------------------------


def test_a_failed_item_is_a_row_with_its_error_and_nan_metrics():
    task = loaded(MULTIPLE_CHOICE, MC, ["acc", "acc_norm"])
    _, rows = rows_for(task, {"1": MC_LLS["1"], "2": ItemOutcome(None, "CUDA out of memory")})  # "3": no result
    assert [r["error"] for r in rows] == [None, "the item failed: CUDA out of memory",
                                          "no result for item 't/3': the job has not finished it"]
    assert math.isnan(rows[1]["acc"]) and math.isnan(rows[1]["acc_norm"]) and rows[1]["lls"] == []
    assert rows[1]["prompt_hash"] and rows[1]["gold"] == [2]
    with pytest.raises(IncompleteTaskError, match=r"task 't': 2 of 3 document\(s\) have no scores \('2': the item "
                                                  r"failed: CUDA out of memory; '3': no result") as caught:
        task_metrics(task, rows)
    assert [doc_id for doc_id, _ in caught.value.failed] == ["2", "3"]
    values = task_metrics(task, rows, allow_failed=True)
    assert (value_of(values, "acc").value, value_of(values, "acc").n, value_of(values, "acc").stderr) == \
        (0.0, 1, None)
    assert task_result(task, values).n_effective == 1


def test_every_document_failed_is_refused_even_when_failures_are_allowed():
    task = loaded(ROLLING, ROLLING_DOCS, ["bits_per_byte"])
    _, rows = rows_for(task, {"x": ItemOutcome(None, "boom"), "y": ItemOutcome(None, "boom")})
    assert math.isnan(rows[0]["ll"]) and rows[0]["bytes"] == 18
    with pytest.raises(IncompleteTaskError, match="2 of 2 document.*; rerun their items$"):
        task_metrics(task, rows, allow_failed=True)


@pytest.mark.parametrize("output, message", [
    ("not json", "the output is not the scoring JSON"),
    ('{"ll": [-1.0], "is_greedy": [true]}', "KeyError"),
    ('{"ll": [-1.0, -2.0], "is_greedy": [true, true], "tokens": [4, 3]}', "2 ll, 2 is_greedy and 2 tokens entries "
                                                                         "for 3 continuations asked"),
    ('{"ll": [-1.0, -2.0, -3.0], "is_greedy": [true, true, true], "tokens": [4, 1, 9]}',
     r"scored \[4, 1, 9\] tokens where the continuations have \[4, 1, 3\]"),
    ('{"ll": [-1.0, NaN, -3.0], "is_greedy": [true, true, true], "tokens": [4, 1, 3]}', "not all numbers"),
])
def test_an_output_that_is_not_what_was_asked_is_a_failure(output, message):
    task = loaded(MULTIPLE_CHOICE, MC[:1], ["acc"])
    _, rows = rows_for(task, {"1": ItemOutcome(output)})
    assert rows[0]["error"] is not None and math.isnan(rows[0]["acc"])
    assert re.search(message, rows[0]["error"]), rows[0]["error"]


def test_items_of_another_task_are_refused():
    task = loaded(MULTIPLE_CHOICE, MC, ["acc"])
    items = task_items(loaded(MULTIPLE_CHOICE, MC[:2], ["acc"]), ENCODER, 100)
    with pytest.raises(ValueError, match=r"2 items for 3 documents; no item for \['3'\]"):
        samples_rows(task, items, {})


def test_rows_missing_a_document_are_refused():
    task = loaded(MULTIPLE_CHOICE, MC, ["acc"])
    _, rows = rows_for(task, MC_LLS)
    with pytest.raises(ValueError, match=r"the rows lack 1 document\(s\) \(\['2'\]\)"):
        task_metrics(task, [r for r in rows if r["doc_id"] != "2"])


def test_outcomes_by_doc_reads_a_jobs_result_rows():
    rows = [{"custom_id": "t/a/1", "output": "x", "error": None}, {"custom_id": "other/1", "output": "y"},
            {"custom_id": "t/2", "output": None, "error": "boom"}]
    assert outcomes_by_doc("t", rows) == {"a/1": ItemOutcome("x"), "2": ItemOutcome(None, "boom")}


# --- the samples file -----------------------------------------------------------------------------------------


def test_samples_round_trip_through_parquet_and_recompute_the_metrics(tmp_path):
    mc = loaded(MULTIPLE_CHOICE, MC, ["acc", "acc_norm"], name="mc")
    rolling = loaded(ROLLING, ROLLING_DOCS, ["bits_per_byte"], name="corpus")
    gen = loaded(GENERATION, GEN, ["exact_match"], name="gen", filters={"strict": STRICT})
    rows = (rows_for(mc, {**MC_LLS, "3": ItemOutcome(None, "boom")})[1]
            + rows_for(rolling, {"x": [-14.0], "y": [-3.0]}, max_length=100)[1]
            + rows_for(gen, {"1": "the answer is 4", "2": "6"}, max_length=300)[1])
    path = tmp_path / "samples.parquet"
    write_samples(path, rows)
    back = read_samples(path)
    assert len(back) == len(rows) == 3 + 2 + 2
    for ours, theirs in zip(rows, back):
        assert ours.keys() == theirs.keys()
        for column in SAMPLE_COLUMNS:
            a, b = ours[column], theirs[column]
            assert (isinstance(a, float) and math.isnan(a) and math.isnan(b)) or a == b, (column, a, b)
    corpus_back = [r for r in back if r["task"] == "corpus"]
    assert metrics.aggregate("bits_per_byte", metric_items(corpus_back, "bits_per_byte")) == \
        pytest.approx(17 / 20 / LN2)
    assert value_of(task_metrics(gen, back), "exact_match", "strict").value == 0.5  # "6" fails the regex
    import pyarrow.parquet as pq

    assert pq.read_schema(path).equals(samples_schema())


def test_write_samples_refuses_an_unknown_column_and_read_samples_another_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(ValueError, match=r"samples row 0 has unknown column\(s\) \['accuracy'\]"):
        write_samples(tmp_path / "s.parquet", [{"task": "t", "accuracy": 1.0}])
    pq.write_table(pa.table({"custom_id": ["a"]}), tmp_path / "results.parquet")
    with pytest.raises(ValueError, match="is not a samples file: it lacks column"):
        read_samples(tmp_path / "results.parquet")


def test_task_result_carries_the_tasks_facts():
    task = loaded(MULTIPLE_CHOICE, MC, ["acc", "acc_norm"], config={"task": "t", "metadata": {"version": 2.0}})
    result = task_result(task, task_metrics(task, rows_for(task, MC_LLS)[1]))
    assert (result.task, result.n_original, result.n_effective, result.version, result.filter_name) == \
        ("t", 4, 3, 2.0, "none")
    assert result.metrics == {"acc": pytest.approx(1 / 3), "acc_norm": pytest.approx(2 / 3)}
    assert set(result.stderrs) == {"acc", "acc_norm"} and result.other_filters == ()


def test_acc_norm_divides_by_the_choice_without_its_delimiter_as_lm_eval():
    """-4/8 > -0.6/1 picks "receives"; counting the delimiter (-4/9 < -0.6/2) would pick "a"."""
    doc = MultipleChoiceDoc("1", "The stage", ("receives", "a"), (0,), target_delimiter=" ")
    _, rows = rows_for(loaded(MULTIPLE_CHOICE, [doc], ["acc", "acc_norm"]), {"1": [-4.0, -0.6]})
    assert (rows[0]["acc"], rows[0]["acc_norm"]) == (0.0, 1.0)
