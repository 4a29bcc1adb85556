"""The results JSON has lm-evaluation-harness's layout: its aggregation writes the same task keys, its make_table reads it."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("lm_eval")
import lm_eval.api.metrics as lm_metrics  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.evaluator_utils import _compute_task_aggregations  # noqa: E402
from lm_eval.result_schema import EvalResults  # noqa: E402

from layerbus.evals import metrics  # noqa: E402
from layerbus.evals.results_json import TaskResult, dumps, results_json  # noqa: E402


def sample_result(name="mc", n=50):
    rng = random.Random(0)
    acc = [float(rng.random() < 0.6) for _ in range(n)]
    acc_norm = [float(rng.random() < 0.5) for _ in range(n)]
    lls = [-rng.random() * 4 for _ in range(n)]
    items = {"acc": acc, "acc_norm": acc_norm, "perplexity": lls}
    return items, TaskResult(
        task=name,
        metrics={m: metrics.aggregate(m, v) for m, v in items.items()},
        stderrs={m: metrics.stderr(m, v, bootstrap_iters=1000) for m, v in items.items()},
        n_original=n + 10,
        n_effective=n,
        config={"task": name, "output_type": "multiple_choice"},
    )


def test_task_entry_equals_lm_evals_own_aggregation(monkeypatch):
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    items, result = sample_result()
    task = type("Task", (), {"task_name": "mc", "aggregation": lambda self: {
        "acc": lm_metrics.mean, "acc_norm": lm_metrics.mean, "perplexity": lm_metrics.perplexity}})()
    theirs, sample_len = _compute_task_aggregations(task, {(m, "none"): v for m, v in items.items()}, 1000)
    ours = results_json([result], {"model": "m"}, date=0.0)["results"]["mc"]
    assert ours == {"name": "mc", "alias": "mc", "sample_len": sample_len, **theirs}


def test_top_level_keys_are_lm_evals_and_its_table_reads_them():
    _, result = sample_result()
    _, other = sample_result("other", 20)
    document = json.loads(dumps(results_json([result, other], {"model": "layerbus", "limit": None}, date=1.5,
                                             layerbus={"stages": 2})))
    required = {k for k in EvalResults.__annotations__ if k in EvalResults.__required_keys__}
    assert required <= set(document) <= set(EvalResults.__annotations__)
    assert document["n-samples"]["mc"] == {"original": 60, "effective": 50}
    assert document["higher_is_better"]["mc"] == {"acc": True, "acc_norm": True, "perplexity": False}
    assert document["config"]["layerbus"] == {"stages": 2}
    table = lm_utils.make_table(document)
    assert "acc_norm" in table and "other" in table and "perplexity" in table


def test_a_missing_stderr_is_written_as_na():
    result = TaskResult("t", {"acc": 1.0}, {"acc": None}, 1, 1)
    assert results_json([result], {}, 0.0)["results"]["t"]["acc_stderr,none"] == "N/A"


def test_repeated_task_names_are_refused():
    result = TaskResult("t", {"acc": 1.0}, {"acc": None}, 1, 1)
    with pytest.raises(ValueError, match="task names repeat"):
        results_json([result, result], {}, 0.0)


def test_a_task_with_two_filters_equals_lm_evals_aggregation(monkeypatch):
    """A YAML with filter_list (gsm8k's strict-match and flexible-extract) reports every metric once per filter."""
    from layerbus.evals.results_json import FilterMetrics

    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    rng = random.Random(1)
    strict = [float(rng.random() < 0.4) for _ in range(30)]
    flexible = [float(rng.random() < 0.7) for _ in range(30)]
    task = type("Task", (), {"task_name": "gen", "aggregation": lambda self: {"exact_match": lm_metrics.mean}})()
    theirs, sample_len = _compute_task_aggregations(
        task, {("exact_match", "strict-match"): strict, ("exact_match", "flexible-extract"): flexible}, 1000)
    result = TaskResult(
        "gen", {"exact_match": metrics.mean(strict)}, {"exact_match": metrics.stderr("exact_match", strict)}, 30, 30,
        filter_name="strict-match",
        other_filters=(FilterMetrics("flexible-extract", {"exact_match": metrics.mean(flexible)},
                                     {"exact_match": metrics.stderr("exact_match", flexible)}),))
    document = results_json([result], {}, 0.0)
    assert document["results"]["gen"] == {"name": "gen", "alias": "gen", "sample_len": sample_len, **theirs}
    assert list(document["results"]["gen"])[3:] == list(theirs)
    assert document["higher_is_better"]["gen"] == {"exact_match": True}
    assert "flexible-extract" in lm_utils.make_table(document)
