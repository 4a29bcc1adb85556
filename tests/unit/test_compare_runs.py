"""Two runs' samples rows compared (evals/compare_runs.py), checked for comparability (run_pairs), their
fingerprints diffed (fingerprint_diff) and a suite's history tabled (history_table): pure functions on rows
built by hand, every expected number worked out here."""

from __future__ import annotations

import json
import math
from datetime import timedelta

import pytest

from layerbus.evals.compare import mcnemar
from layerbus.evals.compare_runs import CompareOptions, MetricKey, compare_runs
from layerbus.evals.fingerprint_diff import ABSENT, fingerprint_changes, summary
from layerbus.evals.history_table import DOWN, SAME, UP, history_table, sparkline
from layerbus.evals.run_pairs import NotComparableError, check_comparable, pair_rows
from layerbus.storage import EvalMetric, EvalRun, canonical_fingerprint
from tests.helpers.eval_runs import FAILED, FINGERPRINT, T0, flipped, mc_row, mc_task, rolling_row

ACC = MetricKey("mc", "acc", "none")
ACC_NORM = MetricKey("mc", "acc_norm", "none")
BPB = MetricKey("corpus", "bits_per_byte", "none")
BASE = [True] * 60 + [False] * 40  # acc 0.6 over 100 documents


def compare(base_rows, cand_rows, keys=(ACC,), **options):
    return compare_runs(base_rows, cand_rows, keys, keys, CompareOptions(**options))


# --- comparability ------------------------------------------------------------------------------------


def test_identical_documents_are_comparable():
    rows = mc_task("mc", BASE)
    check_comparable(rows, mc_task("mc", flipped(BASE, lose=[0])))


def test_changed_prompts_are_refused_naming_count_task_and_documents():
    base = mc_task("mc", BASE[:10])
    cand = [mc_row("mc", r["doc_id"], True, prompt_hash="other") if i in (2, 5, 7) else r for i, r in enumerate(base)]
    with pytest.raises(NotComparableError) as refused:
        check_comparable(base, cand, "job_a", "job_b")
    message = str(refused.value)
    assert message.startswith("not comparable: 3 prompts differ between job_a and job_b: 3 changed (task 'mc': "
                              "q002, q005, q007)")
    assert refused.value.changed == [("mc", "q002"), ("mc", "q005"), ("mc", "q007")]


def test_different_document_sets_are_refused_and_long_lists_cut():
    base = mc_task("mc", BASE[:20]) + [rolling_row("corpus", "only-base", -10.0)]
    cand = mc_task("mc", BASE[:12])
    with pytest.raises(NotComparableError) as refused:
        check_comparable(base, cand, "job_a", "job_b")
    message = str(refused.value)
    assert "not comparable: 9 prompts differ" in message
    assert "9 only in job_a (task 'mc': q012, q013, q014, q015, q016; and 4 more)" in message
    assert len(refused.value.base_only) == 9 and refused.value.cand_only == []


def test_one_prompt_reads_singular():
    with pytest.raises(NotComparableError, match="not comparable: 1 prompt differs between a and b: 1 only in b"):
        check_comparable([], [rolling_row("corpus", "x", -1.0)], "a", "b")


def test_rows_pair_by_task_filter_and_document_in_base_order():
    base = [mc_row("mc", "b", True), mc_row("mc", "a", False)]
    cand = [mc_row("mc", "a", True), mc_row("mc", "b", True)]
    paired = pair_rows(base, cand)
    assert list(paired) == [("mc", "none")]
    assert [(b["doc_id"], c["doc_id"], c["acc"]) for b, c in paired[("mc", "none")].pairs] == [("b", "b", 1.0),
                                                                                               ("a", "a", 1.0)]


# --- 0/1 metrics --------------------------------------------------------------------------------------


def test_a_run_against_itself_changes_nothing():
    rows = mc_task("mc", BASE)
    result = compare(rows, rows, (ACC, ACC_NORM))
    assert [m.row.verdict for m in result.metrics] == ["no significant change"] * 2
    first = result.metrics[0]
    assert (first.row.base, first.row.cand, first.row.diff, first.row.p, first.row.p_holm) == (0.6, 0.6, 0.0, 1.0, 1.0)
    assert (first.row.low, first.row.high) == (0.0, 0.0)
    assert first.flips == () and first.n == 100 and result.regressions == []


@pytest.mark.parametrize("lose, gain, keys, verdict, p_holm", [
    # 10 gained, 2 lost: exact McNemar p = 2 * 79 / 4096 = 0.0386; alone it is significant...
    (range(2), range(60, 70), (ACC,), "better", 2 * 79 / 4096),
    # ...and Holm over two equal tests doubles it past 0.05.
    (range(2), range(60, 70), (ACC, ACC_NORM), "no significant change", 4 * 79 / 4096),
    # 30 lost, 2 gained: 32 discordant documents, chi-squared (|30 - 2| - 1)^2 / 32.
    (range(30), range(60, 62), (ACC,), "worse", mcnemar(30, 2)[0]),
    (range(30), range(60, 62), (ACC, ACC_NORM), "worse", 2 * mcnemar(30, 2)[0]),
])
def test_verdicts_follow_mcnemar_and_holm(lose, gain, keys, verdict, p_holm):
    result = compare(mc_task("mc", BASE), mc_task("mc", flipped(BASE, lose, gain)), keys)
    row = result.metrics[0].row
    assert row.verdict == verdict
    assert row.p_holm == pytest.approx(p_holm)
    assert row.diff == pytest.approx((len(gain) - len(lose)) / 100)
    assert row.cand == pytest.approx(0.6 + (len(gain) - len(lose)) / 100)
    assert (result.metrics[0].gained, result.metrics[0].lost) == (len(gain), len(lose))
    assert bool(result.regressions) == (verdict == "worse")
    assert row.test == ("exact" if len(lose) + len(gain) < 25 else "chi2")


def test_min_effect_keeps_a_small_significant_change_from_a_verdict():
    result = compare(mc_task("mc", BASE), mc_task("mc", flipped(BASE, range(2), range(60, 70))), min_effect=0.1)
    assert result.metrics[0].row.verdict == "below min effect"


def test_flips_carry_choice_margins_and_flag_near_ties():
    base_margins = [1.0] * 100
    base_margins[0], base_margins[1] = 0.0004, 2.5
    base = mc_task("mc", BASE, base_margins)
    cand = mc_task("mc", flipped(BASE, lose=[0, 1], gain=[60]), [0.3] * 100)
    flips = {f.doc_id: f for f in compare(base, cand).metrics[0].flips}
    assert set(flips) == {"q000", "q001", "q060"}
    assert (flips["q000"].gained, flips["q000"].near_tie) == (False, True)
    assert flips["q000"].base_margin == pytest.approx(0.0004) and flips["q000"].cand_margin == pytest.approx(-0.3)
    assert (flips["q001"].base_margin, flips["q001"].cand_margin, flips["q001"].near_tie) == (2.5, pytest.approx(-0.3),
                                                                                              False)
    assert flips["q060"].gained and flips["q060"].base_margin == -1.0
    assert [f.doc_id for f in compare(base, cand).metrics[0].flips][0] == "q000", "smallest margin first"


def test_acc_norm_flips_have_no_margin():
    result = compare(mc_task("mc", BASE), mc_task("mc", flipped(BASE, lose=[0])), (ACC_NORM,))
    assert [(f.doc_id, f.base_margin, f.cand_margin) for f in result.metrics[0].flips] == [("q000", None, None)]


def test_failed_documents_are_left_out_of_both_runs_and_named():
    base_outcomes = [True] * 10 + [False] * 10
    base = mc_task("mc", [None if i == 3 else ok for i, ok in enumerate(base_outcomes)])
    cand = mc_task("mc", [None if i in (3, 15) else ok for i, ok in enumerate(base_outcomes)])
    metric = compare(base, cand).metrics[0]
    assert metric.n == 18
    assert [(e.doc_id, e.failed_in, e.reason) for e in metric.excluded] == [("q003", "both", FAILED),
                                                                            ("q015", "candidate", FAILED)]
    # Both runs over the same 18 documents: 9 right of 18 in each, no flips.
    assert (metric.row.base, metric.row.cand, metric.row.p) == (0.5, 0.5, 1.0)


def test_metrics_in_one_run_only_or_without_documents_are_skipped_with_the_reason():
    base = mc_task("mc", [None] * 4)
    cand = mc_task("mc", [True] * 4)
    exact = MetricKey("mc", "exact_match", "strict")
    result = compare_runs(base, cand, [ACC, exact], [ACC, ACC_NORM], CompareOptions())
    assert result.metrics == ()
    assert [(s.key, s.reason) for s in result.skipped] == [
        (exact, "only in the base run"),
        (ACC_NORM, "only in the candidate run"),
        (ACC, "no document has a acc score in both runs (4 failed)"),
    ]


def test_metrics_follow_the_suite_task_order():
    rows = mc_task("zeta", BASE[:10]) + mc_task("alpha", BASE[:10])
    keys = [MetricKey("alpha", "acc", "none"), MetricKey("zeta", "acc", "none")]
    result = compare_runs(rows, rows, keys, keys, CompareOptions())
    assert [m.key.task for m in result.metrics] == ["zeta", "alpha"]


# --- corpus metrics -----------------------------------------------------------------------------------


def corpus(lls, n_bytes=100):
    return [rolling_row("corpus", f"d{i:02d}", ll, n_bytes) for i, ll in enumerate(lls)]


LLS = [-60.0 - (i % 7) * 3.0 for i in range(30)]


def test_bits_per_byte_is_recomputed_from_the_rows_and_bootstrapped():
    worse = [ll - 2.0 for ll in LLS]  # every document 2 nats less likely
    result = compare(corpus(LLS), corpus(worse), (BPB,), bootstrap_iters=2000)
    row = result.metrics[0].row
    assert row.base == pytest.approx(-sum(LLS) / 3000 / math.log(2))
    assert row.cand == pytest.approx(-sum(worse) / 3000 / math.log(2))
    assert row.diff == pytest.approx(2.0 / 100 / math.log(2))  # 2 nats over 100 bytes, in bits
    assert row.low == pytest.approx(row.diff) and row.high == pytest.approx(row.diff), "the same shift everywhere"
    assert (row.test, row.higher_is_better, row.verdict) == ("bootstrap", False, "worse")
    assert row.p == 0.0
    assert result.metrics[0].flips == ()


def test_a_mixed_corpus_change_is_no_significant_change():
    mixed = [ll + (1.0 if i % 2 else -1.0) for i, ll in enumerate(LLS)]
    row = compare(corpus(LLS), corpus(mixed), (BPB,), bootstrap_iters=2000).metrics[0].row
    assert row.low < 0 < row.high
    assert row.p > 0.05 and row.verdict == "no significant change"


def test_lower_perplexity_is_better():
    keys = (MetricKey("corpus", "word_perplexity", "none"),)
    row = compare(corpus(LLS), corpus([ll + 3.0 for ll in LLS]), keys, bootstrap_iters=1000).metrics[0].row
    assert row.diff < 0 and row.verdict == "better"


def test_failed_corpus_documents_are_left_out():
    cand = corpus([None if i == 4 else ll for i, ll in enumerate(LLS)])
    metric = compare(corpus(LLS), cand, (BPB,), bootstrap_iters=200).metrics[0]
    kept = [ll for i, ll in enumerate(LLS) if i != 4]
    assert metric.n == 29 and [e.doc_id for e in metric.excluded] == ["d04"]
    assert metric.row.base == pytest.approx(-sum(kept) / 2900 / math.log(2)), "the base run without d04 too"


# --- fingerprints -------------------------------------------------------------------------------------


def fingerprint(**changes):
    return canonical_fingerprint({**FINGERPRINT, **changes})[0]


def test_fingerprint_changes_are_sorted_into_parts():
    model = {**FINGERPRINT["model"], "weights": {"model.safetensors": "x" * 64, "extra.safetensors": "e" * 64},
             "chat_template": "a" * 64}
    changes = fingerprint_changes(fingerprint(), fingerprint(model=model, wire="int8", limit=5))
    assert [(c.part, c.path) for c in changes] == [
        ("model weights", "model.weights.extra.safetensors"), ("model weights", "model.weights.model.safetensors"),
        ("tokenizer", "model.chat_template"), ("settings", "limit"), ("settings", "wire")]
    assert changes[0].base is ABSENT
    assert summary(changes) == ('model weights (extra.safetensors added, model.safetensors); tokenizer '
                                '(model.chat_template: null -> "aaaaaaaaaaaa"); settings (limit: null -> 5, '
                                'wire: "float32" -> "int8")')


def test_identical_fingerprints_have_no_changes():
    assert fingerprint_changes(fingerprint(), fingerprint()) == []
    assert summary([]) == "identical"


def test_a_config_change_is_the_config_part():
    model = {**FINGERPRINT["model"], "config": "d" * 64}
    assert [c.part for c in fingerprint_changes(fingerprint(), fingerprint(model=model))] == ["config"]


# --- history table ------------------------------------------------------------------------------------


def run(day, fingerprint_json=None, tasks=("mc", "corpus")):
    text = fingerprint_json or fingerprint()
    return EvalRun(f"job_{day:012d}", "nightly", "m", canonical_fingerprint(json.loads(text))[1], text,
                   json.dumps({"tasks": [{"name": t} for t in tasks]}), T0 + timedelta(days=day))


def test_history_lines_hold_values_changes_and_fingerprint_changes():
    history = [
        (run(0), [EvalMetric("mc", "acc", "none", 0.60, 0.05, 100), EvalMetric("corpus", "bits_per_byte", "none",
                                                                                 1.20, 0.01, 30)]),
        (run(1), [EvalMetric("mc", "acc", "none", 0.62, 0.05, 100)]),
        (run(2, fingerprint(wire="int8")), [EvalMetric("mc", "acc", "none", 0.40, 0.05, 100),
                                            EvalMetric("corpus", "bits_per_byte", "none", 1.20, 0.01, 30)]),
    ]
    table = history_table(history)
    assert [(c.task, c.metric) for c in table.columns] == [("mc", "acc"), ("corpus", "bits_per_byte")], "suite order"
    acc = [line.cells[0] for line in table.lines]
    assert [(c.value, c.change, c.beyond_noise) for c in acc] == [(0.60, "", False), (0.62, UP, False),
                                                                  (0.40, DOWN, True)]
    bpb = [line.cells[1] for line in table.lines]
    assert bpb[1] is None and (bpb[2].change, bpb[2].beyond_noise) == (SAME, False), "against the last run that had it"
    assert [line.fingerprint_changed for line in table.lines] == [False, False, True]
    assert table.trend(0) == "▇█▁" and table.trend(1) == "▄ ▄"


@pytest.mark.parametrize("values, expected", [
    ([1.0, 2.0, 3.0], "▁▅█"), ([5.0, 5.0], "▄▄"), ([math.nan, 0.0, 1.0], " ▁█"), ([], ""),
    ([math.nan], " "),
])
def test_sparkline(values, expected):
    assert sparkline(values) == expected


# --- on rows as the pipeline writes them --------------------------------------------------------------


def test_rows_from_samples_rows_compare_with_margins_and_failures():
    """The real row shapes (doc_results.samples_rows over task_items), not hand-made ones."""
    from layerbus.evals.doc_results import ItemOutcome
    from layerbus.evals.documents import MULTIPLE_CHOICE, MultipleChoiceDoc
    from tests.helpers.eval_rows import loaded, rows_for

    docs = [MultipleChoiceDoc(f"d{i}", "The stage", (" receives", " a", " the sea"), (0,)) for i in range(4)]
    task = loaded(MULTIPLE_CHOICE, docs, ["acc", "acc_norm"], name="mc")
    _, base = rows_for(task, {"d0": [-1.0, -2.0, -3.0], "d1": [-1.0, -1.5, -3.0], "d2": [-2.0, -1.0, -3.0],
                              "d3": [-1.0, -2.0, -3.0]})
    _, cand = rows_for(task, {"d0": [-2.0, -1.9995, -3.0], "d1": [-1.0, -1.5, -3.0], "d2": [-0.5, -1.0, -3.0],
                              "d3": ItemOutcome(None, "stage lost")})
    check_comparable(base, cand)
    (acc,) = compare(base, cand).metrics
    assert (acc.n, [(e.doc_id, e.failed_in) for e in acc.excluded]) == (3, [("d3", "candidate")])
    flips = {f.doc_id: f for f in acc.flips}
    assert set(flips) == {"d0", "d2"}
    assert (flips["d0"].gained, flips["d0"].base_margin, flips["d0"].near_tie) == (False, 1.0, True)
    assert flips["d0"].cand_margin == pytest.approx(-0.0005)
    assert (flips["d2"].gained, flips["d2"].base_margin, flips["d2"].cand_margin) == (True, -1.0, 0.5)
    assert (acc.row.base, acc.row.cand) == (pytest.approx(2 / 3), pytest.approx(2 / 3))
