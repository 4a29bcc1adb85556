"""Paired comparison of two eval runs on the same documents: a p-value and an interval per metric, Holm across the suite.

Two runs of a suite score the same documents, so each document is its own control; a paired test sees a
difference an unpaired z-test needs about 2.8 standard errors to see.
- 0/1 metrics (acc, acc_norm, exact_match): McNemar's test on the discordant documents (b: right before and
  wrong now, c: the reverse). Exact (two-sided binomial, p = min(1, 2 * P(X <= min(b, c))), X ~ Bin(b + c, 1/2))
  while b + c < 25; above that, chi-squared with continuity correction, (|b - c| - 1)^2 / (b + c) on 1
  degree of freedom. 25 is the usual rule of thumb for when the chi-squared approximation is adequate
  (Wikipedia, "McNemar's test"; statsmodels' `mcnemar` documents exact=True for small counts); the exact
  test would be correct everywhere, the switch only keeps the reported statistic familiar.
  Interval: mean paired difference +- 1.96 standard errors of the per-document differences (clustered by
  group when given), as Miller (2024), arXiv:2411.00640, section 4.
- corpus metrics (perplexity, bits_per_byte...): paired bootstrap, resampling documents (the same ones for both
  runs) with a seeded random.Random; interval: 2.5/97.5 percentiles of the resampled differences; p-value: twice
  the smaller tail of the resampled differences beyond zero.
- Holm's step-down correction over every row of the suite; a row's verdict uses the adjusted p-value.
Only the standard library: math.comb for the binomial, math.erfc for the chi-squared tail.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from layerbus.evals.metrics import clustered_mean_stderr, mean_stderr

# Below this many discordant documents McNemar's p-value is exact (see the module docstring).
EXACT_BELOW = 25
# Significance level for the verdicts, after Holm's correction.
ALPHA = 0.05
# z for a two-sided 95% interval.
Z95 = 1.959963984540054


def mcnemar(b: int, c: int) -> tuple[float, str]:
    """Two-sided p-value for b documents lost and c gained, and which test gave it ("exact" or "chi2")."""
    n = b + c
    if n == 0:
        return 1.0, "exact"
    if n < EXACT_BELOW:
        tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
        return min(1.0, 2 * tail / 2**n), "exact"
    statistic = (abs(b - c) - 1) ** 2 / n
    return math.erfc(math.sqrt(statistic / 2)), "chi2"  # survival function of chi-squared with 1 dof


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def paired_difference_interval(base: Sequence[float], cand: Sequence[float],
                               groups: Sequence[str | None] | None = None) -> tuple[float, float, float]:
    """(mean difference, low, high): cand - base per document, 95% interval from its standard error."""
    diffs = [c - b for b, c in zip(base, cand)]
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, mean, mean
    clustered = groups is not None and any(g is not None for g in groups)
    se = clustered_mean_stderr(diffs, groups) if clustered else mean_stderr(diffs)
    return mean, mean - Z95 * se, mean + Z95 * se


def paired_bootstrap(f: Callable[[Sequence], float], base: Sequence, cand: Sequence, iters: int = 10_000,
                     seed: int = 0) -> tuple[float, float, float, float]:
    """(difference, low, high, p) of f(cand) - f(base), resampling the same documents for both runs."""
    if len(base) != len(cand):
        raise ValueError(f"{len(base)=} != {len(cand)=}: a paired comparison needs the same documents")
    observed = f(cand) - f(base)
    rnd, n = random.Random(seed), len(base)
    diffs = []
    for _ in range(iters):
        picks = rnd.choices(range(n), k=n)
        diffs.append(f([cand[i] for i in picks]) - f([base[i] for i in picks]))
    diffs.sort()
    low, high = diffs[int(0.025 * (iters - 1))], diffs[int(math.ceil(0.975 * (iters - 1)))]
    below = sum(d <= 0 for d in diffs) / iters
    above = sum(d >= 0 for d in diffs) / iters
    return observed, low, high, min(1.0, 2 * min(below, above))


@dataclass(frozen=True)
class Flip:
    """A document whose correctness changed between the runs."""

    # The document's id.
    doc_id: str
    # True when the candidate got it right and the base wrong.
    gained: bool
    # Margin in each run (for multiple choice: log-likelihood of the best gold choice minus the best other
    # one; positive means right); None when the metric has none (exact_match).
    base_margin: float | None
    cand_margin: float | None
    # Either margin is within the near-tie threshold: the flip may be rounding, not the model.
    near_tie: bool


def choice_margin(lls: Sequence[float], gold: Sequence[int]) -> float:
    """Best gold log-likelihood minus best other one: > 0 when acc is 1, < 0 when 0 (ties count as wrong)."""
    others = [ll for i, ll in enumerate(lls) if i not in gold]
    return max(lls[i] for i in gold) - (max(others) if others else -math.inf)


def flips(doc_ids: Sequence[str], base: Sequence[float], cand: Sequence[float],
          base_margins: Sequence[float | None] | None = None, cand_margins: Sequence[float | None] | None = None,
          near_tie: float = 1e-3) -> list[Flip]:
    """The documents whose 0/1 score differs, near-ties (|margin| < near_tie) flagged, smallest margins first."""
    none = [None] * len(doc_ids)
    found = []
    for doc_id, b, c, bm, cm in zip(doc_ids, base, cand, base_margins or none, cand_margins or none):
        if b != c:
            tie = any(m is not None and abs(m) < near_tie for m in (bm, cm))
            found.append(Flip(doc_id, c > b, bm, cm, tie))
    return sorted(found, key=lambda f: min(abs(m) for m in (f.base_margin, f.cand_margin, math.inf) if m is not None))


def verdict(diff: float, p_holm: float, higher_is_better: bool, min_effect: float = 0.0,
            alpha: float = ALPHA) -> str:
    """What a row says: significant after Holm and at least min_effect in size, in which direction."""
    if p_holm >= alpha:
        return "no significant change"
    if abs(diff) < min_effect:
        return "below min effect"
    return "better" if (diff > 0) == higher_is_better else "worse"


@dataclass(frozen=True)
class Test:
    """One (task, metric) tested, before Holm's correction joins it with the rest of the suite."""

    task: str
    metric: str
    base: float
    cand: float
    # cand - base, and its 95% interval.
    diff: float
    low: float
    high: float
    # Raw p-value and the test that gave it ("exact", "chi2", "bootstrap").
    p: float
    test: str
    higher_is_better: bool


@dataclass(frozen=True)
class Row(Test):
    """One (task, metric) line of a comparison: the test, with Holm's correction over the suite."""

    p_holm: float
    # "better", "worse", "no significant change" or "below min effect".
    verdict: str


def binary_test(task: str, metric: str, base: Sequence[float], cand: Sequence[float],
                groups: Sequence[str | None] | None = None) -> Test:
    """McNemar plus the paired interval for a 0/1 metric, scores given per document in the same order."""
    if len(base) != len(cand):
        raise ValueError(f"{len(base)=} != {len(cand)=}: a paired comparison needs the same documents")
    lost = sum(1 for b, c in zip(base, cand) if b > c)
    gained = sum(1 for b, c in zip(base, cand) if c > b)
    p, test = mcnemar(lost, gained)
    diff, low, high = paired_difference_interval(base, cand, groups)
    n = len(base)
    return Test(task, metric, sum(base) / n, sum(cand) / n, diff, low, high, p, test, True)


def corpus_test(task: str, metric: str, f: Callable[[Sequence], float], base: Sequence, cand: Sequence,
                higher_is_better: bool, iters: int = 10_000, seed: int = 0) -> Test:
    """The paired bootstrap for a corpus metric, items given per document in the same order."""
    diff, low, high, p = paired_bootstrap(f, base, cand, iters, seed)
    return Test(task, metric, f(base), f(cand), diff, low, high, p, "bootstrap", higher_is_better)


def suite_rows(tests: Sequence[Test], min_effect: float = 0.0, alpha: float = ALPHA) -> list[Row]:
    """Every test of a suite with its Holm-adjusted p-value and verdict."""
    adjusted = holm([t.p for t in tests])
    return [
        Row(**{f.name: getattr(t, f.name) for f in fields(Test)}, p_holm=p_holm,
            verdict=verdict(t.diff, p_holm, t.higher_is_better, min_effect, alpha))
        for t, p_holm in zip(tests, adjusted)
    ]
