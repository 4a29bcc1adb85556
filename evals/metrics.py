"""Eval metrics as lm-evaluation-harness defines them: per-document scores, their aggregation, and standard errors.

Mirrors lm-eval 0.4.x (`lm_eval/api/task.py` ConfigurableTask.process_results, `lm_eval/api/metrics.py`):
- acc: the choice with the highest log-likelihood is a gold one (ties go to the first, as np.argmax);
  acc_norm: the same on log-likelihood divided by the choice's length in characters.
- exact_match: the (filtered) generation equals any target, after lm-eval's optional ignore_case /
  ignore_punctuation / ignore_numbers / regexes_to_ignore.
- perplexity (loglikelihood tasks): exp(-mean ll); word_perplexity, byte_perplexity: exp(-sum ll / sum words
  or bytes); bits_per_byte: -sum ll / sum bytes / ln 2. Words are re.split(r"\\s+", text) pieces.
- Standard errors: sample std / sqrt(n) for means; lm-eval's bootstrap (chunks of 1000 resamples, chunk i
  drawn by random.Random(i)) for perplexity. lm-eval reports "N/A" for the weighted corpus metrics; we give
  them the same bootstrap, since a comparison needs an error for them too.
- Clustered by group (documents that share a passage are not independent): the mean's standard error is
  Miller (2024), "Adding Error Bars to Evals", arXiv:2411.00640, section 2.2: SE_clustered^2 = SE^2 +
  (1/n^2) * sum over clusters of the cross products of within-cluster residuals; corpus metrics resample
  whole clusters. Documents without a group are clusters of one, so with no groups both equal lm-eval's.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Pairs (log-likelihood, count of words or bytes) for the weighted corpus metrics.
Weighted = tuple[float, int]


@dataclass(frozen=True)
class MetricInfo:
    """How one metric aggregates over documents, as lm-eval registers it."""

    # Name of the aggregation: mean, perplexity, weighted_perplexity or bits_per_byte.
    aggregation: str
    # Whether a larger value is better (decides what "worse" means when comparing runs).
    higher_is_better: bool


METRICS = {
    "acc": MetricInfo("mean", True),
    "acc_norm": MetricInfo("mean", True),
    "exact_match": MetricInfo("mean", True),
    "perplexity": MetricInfo("perplexity", False),
    "word_perplexity": MetricInfo("weighted_perplexity", False),
    "byte_perplexity": MetricInfo("weighted_perplexity", False),
    "bits_per_byte": MetricInfo("bits_per_byte", False),
}
# lm-eval's default number of bootstrap resamples (simple_evaluate's bootstrap_iters).
BOOTSTRAP_ITERS = 100_000


# --- per-document scores -------------------------------------------------------------------------------


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one on ties, as np.argmax."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def multiple_choice_scores(lls: Sequence[float], choices: Sequence[str], gold: Sequence[int]) -> dict[str, float]:
    """acc and acc_norm of one multiple-choice document from its per-choice log-likelihoods."""
    if len(lls) != len(choices):
        raise ValueError(f"{len(lls)=} does not match {len(choices)=}")
    normalized = [ll / float(len(choice)) for ll, choice in zip(lls, choices)]
    return {
        "acc": 1.0 if argmax(lls) in gold else 0.0,
        "acc_norm": 1.0 if argmax(normalized) in gold else 0.0,
    }


def loglikelihood_scores(ll: float, is_greedy: bool) -> dict[str, float]:
    """A (context, continuation) document: perplexity's item is the ll itself; acc is whether it is greedy."""
    return {"perplexity": ll, "acc": int(is_greedy)}


def count_words(text: str) -> int:
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def rolling_scores(ll: float, text: str) -> dict[str, Weighted]:
    """A rolling document's items for the weighted corpus metrics."""
    return {
        "word_perplexity": (ll, count_words(text)),
        "byte_perplexity": (ll, count_bytes(text)),
        "bits_per_byte": (ll, count_bytes(text)),
    }


def exact_match(
    prediction: str,
    targets: Sequence[str],
    ignore_case: bool = False,
    ignore_punctuation: bool = False,
    ignore_numbers: bool = False,
    regexes_to_ignore: Sequence[str] = (),
) -> float:
    """1.0 when the prediction equals any target after the same normalization, as lm-eval's exact_match."""

    def normalize(text: str) -> str:
        for pattern in regexes_to_ignore:
            text = re.sub(pattern, "", text)
        if ignore_case:
            text = text.lower()
        if ignore_punctuation:
            text = text.translate(str.maketrans("", "", string.punctuation))
        if ignore_numbers:
            text = text.translate(str.maketrans("", "", string.digits))
        return text

    return 1.0 if any(normalize(prediction) == normalize(t) for t in targets) else 0.0


# --- aggregations --------------------------------------------------------------------------------------


def mean(items: Sequence[float]) -> float:
    return sum(items) / len(items)


def perplexity(items: Sequence[float]) -> float:
    return math.exp(-mean(items))


def weighted_mean(items: Sequence[Weighted]) -> float:
    return sum(ll for ll, _ in items) / sum(count for _, count in items)


def weighted_perplexity(items: Sequence[Weighted]) -> float:
    return math.exp(-weighted_mean(items))


def bits_per_byte(items: Sequence[Weighted]) -> float:
    return -weighted_mean(items) / math.log(2)


AGGREGATIONS: dict[str, Callable] = {
    "mean": mean,
    "perplexity": perplexity,
    "weighted_perplexity": weighted_perplexity,
    "bits_per_byte": bits_per_byte,
}


def aggregate(metric: str, items: Sequence) -> float:
    """The metric's corpus value from its per-document items."""
    return AGGREGATIONS[METRICS[metric].aggregation](items)


# --- standard errors -----------------------------------------------------------------------------------


def sample_stddev(items: Sequence[float]) -> float:
    mu = mean(items)
    return math.sqrt(sum((x - mu) ** 2 for x in items) / (len(items) - 1))


def mean_stderr(items: Sequence[float]) -> float:
    return sample_stddev(items) / math.sqrt(len(items))


def clustered_mean_stderr(items: Sequence[float], groups: Sequence[str | None]) -> float:
    """The mean's standard error when documents of one group are correlated (Miller 2024, section 2.2)."""
    mu, n = mean(items), len(items)
    residuals_by_group: dict[object, list[float]] = {}
    for i, (x, group) in enumerate(zip(items, groups)):
        residuals_by_group.setdefault(("group", group) if group is not None else ("doc", i), []).append(x - mu)
    # sum over i != j in a cluster of r_i * r_j = (sum r)^2 - sum r^2
    cross = sum(sum(r) ** 2 - sum(v * v for v in r) for r in residuals_by_group.values())
    variance = mean_stderr(items) ** 2 + cross / n**2
    return math.sqrt(max(variance, 0.0))


def bootstrap_stderr(f: Callable[[Sequence], float], items: Sequence, iters: int) -> float:
    """lm_eval.api.metrics.bootstrap_stderr, without its process pool: same resamples, same result."""
    replicates = []
    chunk = min(1000, iters)
    for i in range(iters // chunk):
        rnd = random.Random(i)
        replicates += [f(rnd.choices(items, k=len(items))) for _ in range(chunk)]
    return sample_stddev(replicates)


def cluster_bootstrap_stderr(f: Callable[[Sequence], float], items: Sequence, groups: Sequence[str | None],
                             iters: int) -> float:
    """bootstrap_stderr resampling whole groups; with every document its own group it is bootstrap_stderr."""
    clusters = _clusters(items, groups)
    replicates = []
    chunk = min(1000, iters)
    for i in range(iters // chunk):
        rnd = random.Random(i)
        for _ in range(chunk):
            replicates.append(f([x for c in rnd.choices(clusters, k=len(clusters)) for x in c]))
    return sample_stddev(replicates)


def _clusters(items: Sequence, groups: Sequence[str | None]) -> list[list]:
    by_key: dict[object, list] = {}
    for i, (x, group) in enumerate(zip(items, groups)):
        by_key.setdefault(("group", group) if group is not None else ("doc", i), []).append(x)
    return list(by_key.values())


def stderr(metric: str, items: Sequence, groups: Sequence[str | None] | None = None,
           bootstrap_iters: int = BOOTSTRAP_ITERS) -> float | None:
    """The metric's standard error as lm-eval computes it (None where it reports "N/A"), clustered by groups."""
    if len(items) < 2 or bootstrap_iters <= 0:
        return None
    aggregation = METRICS[metric].aggregation
    clustered = groups is not None and any(g is not None for g in groups)
    if aggregation == "mean":
        return clustered_mean_stderr(items, groups) if clustered else mean_stderr(items)
    f = AGGREGATIONS[aggregation]
    if clustered:
        return cluster_bootstrap_stderr(f, items, groups, bootstrap_iters)
    return bootstrap_stderr(f, items, bootstrap_iters)
