"""Paired comparison: McNemar (exact and chi-squared), Holm, paired bootstrap, verdicts and flipped documents."""

from __future__ import annotations

import math
import random

import pytest

from layerbus.evals.compare import (
    Flip,
    binary_test,
    choice_margin,
    corpus_test,
    flips,
    holm,
    mcnemar,
    paired_bootstrap,
    suite_rows,
    verdict,
)
from layerbus.evals.metrics import bits_per_byte, perplexity


def test_the_hand_computed_case_10_against_2():
    # Bin(12, 1/2): P(X <= 2) = (1 + 12 + 66) / 4096; two-sided doubles it.
    p, test = mcnemar(10, 2)
    assert test == "exact"
    assert p == pytest.approx(2 * 79 / 4096)
    assert round(p, 4) == 0.0386
    assert mcnemar(2, 10) == (p, "exact")


@pytest.mark.parametrize(
    "b, c, expected, test",
    [
        (0, 0, 1.0, "exact"),
        (3, 3, 1.0, "exact"),
        (5, 0, 2 / 32, "exact"),
        (12, 12, 1.0, "exact"),  # 24 discordant documents: the last exact row
        (13, 12, 1.0, "chi2"),  # (|13 - 12| - 1)^2 = 0: no evidence at all
        (30, 10, math.erfc(math.sqrt((19**2 / 40) / 2)), "chi2"),
    ],
)
def test_mcnemar_table(b, c, expected, test):
    p, used = mcnemar(b, c)
    assert used == test
    assert p == pytest.approx(expected)


def test_mcnemar_switches_to_chi_squared_at_25_discordant_documents():
    assert mcnemar(12, 12)[1] == "exact"
    assert mcnemar(13, 12)[1] == "chi2"


def test_mcnemar_matches_scipy_where_scipy_is_installed():
    stats = pytest.importorskip("scipy.stats")
    for b in range(0, 30):
        for c in range(0, 30):
            p, test = mcnemar(b, c)
            if test == "exact":
                expected = stats.binomtest(b, b + c, 0.5).pvalue if b + c else 1.0
            else:
                expected = stats.chi2.sf((abs(b - c) - 1) ** 2 / (b + c), 1)
            assert p == pytest.approx(expected, rel=1e-9, abs=1e-15), (b, c)


@pytest.mark.parametrize(
    "p_values, expected",
    [
        ([0.01, 0.04, 0.03], [0.03, 0.06, 0.06]),
        ([0.5], [0.5]),
        ([0.001, 0.2, 0.9, 0.01], [0.004, 0.4, 0.9, 0.03]),
        ([0.4, 0.4], [0.8, 0.8]),
        ([0.6, 0.7], [1.0, 1.0]),
    ],
)
def test_holm_table(p_values, expected):
    assert holm(p_values) == pytest.approx(expected)


@pytest.mark.parametrize(
    "diff, p_holm, higher_is_better, min_effect, expected",
    [
        (0.05, 0.01, True, 0.0, "better"),
        (-0.05, 0.01, True, 0.0, "worse"),
        (0.3, 0.01, False, 0.0, "worse"),  # perplexity went up
        (-0.3, 0.01, False, 0.0, "better"),
        (-0.05, 0.2, True, 0.0, "no significant change"),
        (-0.005, 0.01, True, 0.01, "below min effect"),
    ],
)
def test_verdict_table(diff, p_holm, higher_is_better, min_effect, expected):
    assert verdict(diff, p_holm, higher_is_better, min_effect) == expected


def test_choice_margin_is_positive_when_right_and_negative_when_wrong():
    assert choice_margin([-1.0, -2.5, -3.0], [0]) == pytest.approx(1.5)
    assert choice_margin([-1.0, -2.5, -3.0], [2]) == pytest.approx(-2.0)
    assert choice_margin([-1.0, -1.0], [1]) == 0.0


def test_flips_list_changed_documents_with_near_ties_first():
    found = flips(["a", "b", "c", "d"], [1, 0, 1, 1], [0, 1, 1, 0],
                  base_margins=[0.5, -2.0, 1.0, 0.0004], cand_margins=[-0.3, 1.5, 1.0, -0.0002])
    assert found == [
        Flip("d", False, 0.0004, -0.0002, True),
        Flip("a", False, 0.5, -0.3, False),
        Flip("b", True, -2.0, 1.5, False),
    ]


def test_binary_test_reports_means_difference_and_interval():
    base = [1.0] * 10 + [0.0] * 2 + [1.0] * 20
    cand = [0.0] * 10 + [1.0] * 2 + [1.0] * 20
    t = binary_test("mc", "acc", base, cand)
    assert (t.base, t.cand) == (30 / 32, 22 / 32)
    assert t.diff == pytest.approx(-8 / 32)
    assert t.low < t.diff < t.high < 0
    assert round(t.p, 4) == 0.0386 and t.test == "exact"


def test_paired_bootstrap_is_seeded_and_sees_a_paired_shift():
    rng = random.Random(1)
    base = [-rng.random() * 3 for _ in range(80)]
    cand = [x - 0.05 for x in base]  # every document slightly worse: unpaired noise would hide it
    first = paired_bootstrap(perplexity, base, cand, iters=500, seed=7)
    assert first == paired_bootstrap(perplexity, base, cand, iters=500, seed=7)
    diff, low, high, p = first
    assert diff > 0 and 0 < low <= high and p < 0.01
    assert paired_bootstrap(perplexity, base, base, iters=200, seed=7)[3] == 1.0


def test_a_suite_is_corrected_together_and_a_regression_is_named():
    rng = random.Random(2)
    base_acc = [float(rng.random() < 0.7) for _ in range(200)]
    cand_acc = [0.0 if (b and rng.random() < 0.25) else b for b in base_acc]
    weighted = [(-rng.random() * 100, rng.randint(50, 200)) for _ in range(60)]
    tests = [
        binary_test("mc", "acc", base_acc, cand_acc),
        binary_test("mc", "acc_norm", base_acc, base_acc),
        corpus_test("corpus", "bits_per_byte", bits_per_byte, weighted, weighted, False, iters=200),
    ]
    rows = suite_rows(tests)
    assert [r.verdict for r in rows] == ["worse", "no significant change", "no significant change"]
    assert rows[0].p_holm == pytest.approx(min(1.0, 3 * rows[0].p))
