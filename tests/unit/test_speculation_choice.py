"""The planner's choice of how far to draft (planner.speculation): a table of cases, the expected-tokens
arithmetic, the acceptance estimate, the trip-cost fit and the --speculate values."""

from __future__ import annotations

import pytest

from layerbus.planner.speculation import (
    SpeculationConfig,
    TripCost,
    choose_draft_length,
    estimated_acceptance,
    expected_tokens,
    fit_trip_cost,
    parse_speculate,
)

# (case, acceptance, fixed s, per-position s, rows, positions without drafts, max k, min k, chosen k)
CASES = [
    ("few rows, slow links: draft as far as allowed", 0.8, 0.020, 0.0005, 2, 2, 4, 0, 4),
    ("full micro-batch of compute-bound stages: none", 0.5, 0.002, 0.004, 32, 32, 4, 0, 0),
    ("drafts never accepted: none", 0.0, 0.020, 0.0005, 2, 2, 4, 0, 0),
    ("an explicit drafter drafts at least one", 0.0, 0.020, 0.0005, 2, 2, 4, 1, 1),
    ("good acceptance, a busy step: short of the most", 0.7, 0.010, 0.0004, 16, 64, 4, 0, 3),
    ("middling acceptance, a busier step: less", 0.5, 0.010, 0.0008, 16, 64, 4, 0, 1),
    ("perfect acceptance, free positions: the most", 1.0, 0.010, 0.0, 8, 8, 6, 0, 6),
    ("no rows that could draft", 0.9, 0.010, 0.001, 0, 40, 4, 0, 0),
]


@pytest.mark.parametrize("case, acceptance, fixed, per_position, rows, positions, max_k, min_k, expected", CASES,
                         ids=[case[0] for case in CASES])
def test_draft_length_table(case, acceptance, fixed, per_position, rows, positions, max_k, min_k, expected):
    choice = choose_draft_length(acceptance, TripCost(fixed, per_position), rows, positions, max_k, min_k)
    assert choice.drafts == expected, case
    if expected == 0:
        assert choice.speedup == pytest.approx(1.0)
    else:
        rate = lambda k: rows * expected_tokens(acceptance, k) / (fixed + per_position * (positions + rows * k))
        assert choice.speedup == pytest.approx(rate(expected) / rate(0))
        assert all(rate(expected) >= rate(k) * (1 - 1e-9) for k in range(min_k, max_k + 1))


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1


def test_acceptance_estimate_starts_at_the_prior_and_follows_the_counts():
    assert estimated_acceptance(0, 0) == 0.5
    assert estimated_acceptance(98, 0) == pytest.approx(0.99)
    assert estimated_acceptance(0, 98) == pytest.approx(0.01)


def test_trip_cost_fit_recovers_a_line_and_waits_for_two_sizes():
    assert fit_trip_cost([(8, 0.1), (8, 0.12)]) is None
    cost = fit_trip_cost([(p, 0.01 + 0.002 * p) for p in (4, 8, 16, 32)])
    assert cost.fixed_s == pytest.approx(0.01) and cost.per_position_s == pytest.approx(0.002)
    # Noise that slopes down is taken as no per-position cost, never a negative one.
    assert fit_trip_cost([(4, 0.05), (16, 0.04)]).per_position_s == 0.0


@pytest.mark.parametrize("text, mode", [("auto", "auto"), ("off", "off"), ("ngram", "ngram"), (" suffix ", "suffix")])
def test_speculate_values(text, mode):
    assert parse_speculate(text) == SpeculationConfig(mode=mode)


@pytest.mark.parametrize("text, words", [("model:/models/draft", "not available yet"), ("eagle", "choose one of")])
def test_speculate_values_refused_name_the_value_and_the_way_out(text, words):
    with pytest.raises(ValueError) as error:
        parse_speculate(text)
    assert words in str(error.value) and text.split(":")[0] in str(error.value) and "ngram" in str(error.value)
