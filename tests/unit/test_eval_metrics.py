"""Metrics and standard errors equal lm-evaluation-harness's, its own functions called on the same random data."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("lm_eval")
import lm_eval.api.metrics as lm_metrics  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402

from layerbus.evals import metrics  # noqa: E402


class LmEvalScoring:
    """ConfigurableTask.process_results, unchanged, on an object holding only what it reads."""

    process_results = ConfigurableTask.process_results
    count_words = ConfigurableTask.count_words
    count_bytes = ConfigurableTask.count_bytes
    multiple_input = False

    def __init__(self, output_type, metric_names, choices=None, target=None):
        self.OUTPUT_TYPE = output_type
        self.config = type("Config", (), {"process_results": None})()
        self._metric_fn_list = {name: None for name in metric_names}
        self._choices, self._target = choices, target
        self.multiple_target = isinstance(target, list)

    def doc_to_choice(self, doc):
        return self._choices

    def doc_to_target(self, doc):
        return self._target


def random_choices(rng):
    return ["".join(rng.choice("ab é日 ") for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(2, 5))]


@pytest.mark.parametrize("seed", range(300))
def test_acc_and_acc_norm_equal_process_results(seed):
    rng = random.Random(seed)
    choices = random_choices(rng)
    # Coarse values make ties (argmax must take the first one, as np.argmax does).
    lls = [-rng.choice([1, 2, 3, 4.5, rng.random() * 20]) for _ in choices]
    gold = rng.randrange(len(choices)) if seed % 3 else rng.sample(range(len(choices)), 2)
    theirs = LmEvalScoring("multiple_choice", ["acc", "acc_norm"], choices, gold).process_results(
        {}, [(ll, False) for ll in lls])
    golds = gold if isinstance(gold, list) else [gold]
    assert metrics.multiple_choice_scores(lls, choices, golds) == {"acc": theirs["acc"], "acc_norm": theirs["acc_norm"]}


@pytest.mark.parametrize("seed", range(50))
def test_rolling_items_equal_process_results(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["word", " ", "  ", "\n", "é", "日本", "\t", "x"]) for _ in range(rng.randint(1, 30)))
    ll = -rng.random() * 100
    names = ["word_perplexity", "byte_perplexity", "bits_per_byte"]
    assert metrics.rolling_scores(ll, text) == LmEvalScoring("loglikelihood_rolling", names, target=text).process_results({}, (ll,))


def test_loglikelihood_items_equal_process_results():
    for ll, greedy in [(-1.5, True), (-0.2, False)]:
        theirs = LmEvalScoring("loglikelihood", ["perplexity", "acc"]).process_results({}, [(ll, greedy)])
        assert metrics.loglikelihood_scores(ll, greedy) == theirs


STRINGS = ["Paris", "paris", "Paris.", " Paris", "Paris ", "42", "4 2", "The answer is 42.", "", "ÉTÉ", "été", "a-b"]
OPTIONS = [{}, {"ignore_case": True}, {"ignore_punctuation": True}, {"ignore_numbers": True},
           {"regexes_to_ignore": [r"\s+", "^the answer is "]},
           {"ignore_case": True, "ignore_punctuation": True, "regexes_to_ignore": ["answer"]}]


@pytest.mark.parametrize("options", OPTIONS)
def test_exact_match_equals_lm_eval(options):
    rng = random.Random(str(options))
    for _ in range(200):
        prediction = rng.choice(STRINGS)
        targets = rng.sample(STRINGS, rng.randint(1, 3))
        # lm-eval scores a multi-target document as the predictions repeated against every target, any match wins
        theirs = lm_metrics.exact_match_hf_evaluate(
            predictions=[prediction] * len(targets), references=targets, **options)["exact_match"]
        assert metrics.exact_match(prediction, targets, **options) == (1.0 if theirs > 0 else 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_aggregations_and_mean_stderr_equal_lm_eval(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 200)
    scores = [float(rng.random() < 0.6) for _ in range(n)]
    lls = [-rng.random() * 5 for _ in range(n)]
    weighted = [(-rng.random() * 300, rng.randint(1, 400)) for _ in range(n)]
    assert metrics.mean(scores) == lm_metrics.mean(scores)
    assert metrics.mean_stderr(scores) == lm_metrics.mean_stderr(scores)
    assert metrics.perplexity(lls) == lm_metrics.perplexity(lls)
    assert metrics.weighted_perplexity(weighted) == lm_metrics.weighted_perplexity(weighted)
    assert metrics.bits_per_byte(weighted) == lm_metrics.bits_per_byte(weighted)
    for name, items in [("acc", scores), ("perplexity", lls), ("word_perplexity", weighted),
                        ("bits_per_byte", weighted)]:
        lm_aggregation = getattr(lm_metrics, metrics.METRICS[name].aggregation)
        assert metrics.aggregate(name, items) == lm_aggregation(items)


@pytest.mark.parametrize("seed, iters", [(0, 500), (1, 2000), (2, 3000), (3, 1000)])
def test_bootstrap_stderr_equals_lm_eval(monkeypatch, seed, iters):
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # lm-eval's pool gives the same numbers; no processes here
    rng = random.Random(seed)
    lls = [-rng.random() * 5 for _ in range(rng.randint(5, 60))]
    weighted = [(-rng.random() * 300, rng.randint(1, 400)) for _ in range(len(lls))]
    assert metrics.stderr("perplexity", lls, bootstrap_iters=iters) == \
        lm_metrics.stderr_for_metric(lm_metrics.perplexity, iters)(lls)
    # lm-eval reports N/A for the weighted metrics; ours is its bootstrap on their aggregation.
    assert lm_metrics.stderr_for_metric(lm_metrics.bits_per_byte, iters) is None
    assert metrics.stderr("bits_per_byte", weighted, bootstrap_iters=iters) == \
        lm_metrics.bootstrap_stderr(lm_metrics.bits_per_byte, weighted, iters)


def test_stderr_of_means_equals_stderr_for_metric():
    rng = random.Random(5)
    scores = [float(rng.random() < 0.3) for _ in range(77)]
    assert metrics.stderr("acc", scores) == lm_metrics.stderr_for_metric(lm_metrics.mean, 100)(scores)
    assert metrics.stderr("acc", [1.0]) is None  # lm-eval: "N/A" for a single item


def test_clusters_of_one_give_the_unclustered_errors():
    rng = random.Random(9)
    scores = [float(rng.random() < 0.5) for _ in range(40)]
    lls = [-rng.random() for _ in range(40)]
    groups = [f"g{i}" for i in range(40)]
    assert metrics.stderr("acc", scores, groups) == pytest.approx(metrics.mean_stderr(scores), rel=1e-12)
    assert metrics.stderr("perplexity", lls, groups, 1000) == metrics.stderr("perplexity", lls, None, 1000)


@pytest.mark.parametrize(
    "items, groups, expected",
    [
        # Two clusters of two, perfectly correlated within: residuals +-0.5, cross terms 2*(0.25) per cluster.
        ([1.0, 1.0, 0.0, 0.0], ["a", "a", "b", "b"], math.sqrt(1 / 3 / 4 + (0.5 + 0.5) / 16)),
        # Anti-correlated within clusters: the cross terms shrink the error to zero.
        ([1.0, 0.0, 1.0, 0.0], ["a", "a", "b", "b"], math.sqrt(1 / 3 / 4 - (0.5 + 0.5) / 16)),
    ],
)
def test_clustered_mean_stderr_table(items, groups, expected):
    assert metrics.clustered_mean_stderr(items, groups) == pytest.approx(expected)


def test_correlated_groups_widen_the_error():
    items = [1.0] * 10 + [0.0] * 10
    groups = ["a"] * 10 + ["b"] * 10
    assert metrics.stderr("acc", items, groups) > 2 * metrics.stderr("acc", items)
    assert metrics.stderr("perplexity", [-x - 0.1 for x in items], groups, 1000) > \
        metrics.stderr("perplexity", [-x - 0.1 for x in items], None, 1000)
