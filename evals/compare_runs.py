"""Two eval runs of the same documents compared metric by metric, from their samples rows (doc_results).

For each (task, metric, filter) both runs report:
- 0/1 metrics (acc, acc_norm, exact_match): McNemar and the paired interval on the per-document scores
  (compare.binary_test), and the documents whose score flipped. A multiple-choice acc flip carries each
  run's choice_margin (best gold log-likelihood minus best other one), so a flip from +0.0002 to -0.0001
  reads as the near-tie it is; acc_norm has no margin here because the samples do not hold the choices'
  lengths it divides by, and exact_match and a log-likelihood task's acc (is the continuation greedy) have
  none at all.
- corpus metrics (perplexity, word_perplexity, byte_perplexity, bits_per_byte): the paired bootstrap of
  metrics.aggregate over the per-document items (doc_results.metric_items), the same documents resampled
  for both runs (compare.corpus_test).
Then Holm's correction over every tested row of the suite, and a verdict per row (compare.suite_rows).

A document that failed in either run (its row has an error, or no value for the metric) is left out of that
metric in both runs, so the pairs stay pairs; each comparison lists what it left out and why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from layerbus.evals import metrics as metric_defs
from layerbus.evals.compare import ALPHA, Flip, Row, Test, binary_test, choice_margin, corpus_test, flips, suite_rows
from layerbus.evals.doc_results import CORPUS_ITEMS, SCORE_COLUMNS, metric_items
from layerbus.evals.documents import MULTIPLE_CHOICE
from layerbus.evals.run_pairs import PairedRows, pair_rows

WORSE = "worse"


@dataclass(frozen=True)
class MetricKey:
    """One metric of one task under one filter, as eval_metrics keys it."""

    task: str
    metric: str
    filter: str


@dataclass(frozen=True)
class CompareOptions:
    """How strict a comparison is, and how it resamples."""

    # Smallest |candidate - base| a significant row needs to be called better or worse, in the metric's units
    # (0.01 = one point of acc); smaller significant differences read "below min effect".
    min_effect: float = 0.0
    # Significance level after Holm's correction.
    alpha: float = ALPHA
    # Paired bootstrap resamples for corpus metrics, and their seed (fixed: the same runs compare the same way).
    bootstrap_iters: int = 10_000
    seed: int = 0
    # |margin| below this flags a flip as a near-tie (log-likelihood units).
    near_tie: float = 1e-3


@dataclass(frozen=True)
class ExcludedDoc:
    """A document left out of one metric because it has no score in one run or both."""

    doc_id: str
    # "base", "candidate" or "both".
    failed_in: str
    # The row's error (the base's when both failed), or what value is missing.
    reason: str


@dataclass(frozen=True)
class MetricComparison:
    """One compared (task, metric, filter): the tested row with Holm's p-value and verdict, and its documents."""

    key: MetricKey
    row: Row
    # Documents compared (both runs have a score).
    n: int
    # Documents left out, in document order.
    excluded: tuple[ExcludedDoc, ...]
    # 0/1 metrics: the documents whose score flipped, smallest margins first; empty for corpus metrics.
    flips: tuple[Flip, ...]

    @property
    def gained(self) -> int:
        return sum(1 for f in self.flips if f.gained)

    @property
    def lost(self) -> int:
        return sum(1 for f in self.flips if not f.gained)


@dataclass(frozen=True)
class SkippedMetric:
    """A metric not compared, and why (in one run only, no documents left, a metric with no paired test)."""

    key: MetricKey
    reason: str


@dataclass(frozen=True)
class RunComparison:
    """Every compared metric of the suite, in task order, and the ones left out."""

    metrics: tuple[MetricComparison, ...]
    skipped: tuple[SkippedMetric, ...]
    options: CompareOptions

    @property
    def regressions(self) -> list[MetricComparison]:
        """The rows significantly worse after Holm (and at least min_effect worse)."""
        return [m for m in self.metrics if m.row.verdict == WORSE]


def compare_runs(base_rows: Sequence[Mapping], cand_rows: Sequence[Mapping], base_metrics: Sequence[MetricKey],
                 cand_metrics: Sequence[MetricKey], options: CompareOptions = CompareOptions()) -> RunComparison:
    """Compare the metrics both runs report, on their paired samples rows.

    Check the runs with run_pairs.check_comparable first: this pairs rows by (task, filter, doc_id) and
    trusts that equal keys asked the same thing.
    """
    paired = pair_rows(base_rows, cand_rows)
    task_order = {task: i for i, task in enumerate(dict.fromkeys(row["task"] for row in base_rows))}
    in_base = set(base_metrics)
    keys = sorted((k for k in dict.fromkeys(cand_metrics) if k in in_base),
                  key=lambda k: task_order.get(k.task, len(task_order)))  # stable: the given order within a task
    compared = set(keys)
    skipped = [SkippedMetric(k, "only in the base run") for k in dict.fromkeys(base_metrics) if k not in compared]
    skipped += [SkippedMetric(k, "only in the candidate run") for k in dict.fromkeys(cand_metrics) if k not in in_base]
    tested: list[tuple[MetricKey, Test, int, tuple[ExcludedDoc, ...], tuple[Flip, ...]]] = []
    for key in keys:
        rows = paired.get((key.task, key.filter))
        reason = _untestable(key, rows)
        if reason is None:
            kept, excluded = _scored_pairs(key.metric, rows)
            if kept:
                test, found = _test(key, kept, options)
                tested.append((key, test, len(kept), excluded, found))
                continue
            reason = f"no document has a {key.metric} score in both runs ({len(excluded)} failed)"
        skipped.append(SkippedMetric(key, reason))
    judged = suite_rows([t for _, t, *_ in tested], options.min_effect, options.alpha)
    comparisons = tuple(MetricComparison(key, row, n, excluded, found)
                        for (key, _, n, excluded, found), row in zip(tested, judged))
    return RunComparison(comparisons, tuple(skipped), options)


def _untestable(key: MetricKey, rows: PairedRows | None) -> str | None:
    if key.metric not in SCORE_COLUMNS and key.metric not in CORPUS_ITEMS:
        return f"no paired test for metric {key.metric!r} (known: {', '.join(SCORE_COLUMNS + tuple(CORPUS_ITEMS))})"
    if rows is None:
        return "no samples rows of this task and filter in both runs"
    return None


def _scored_pairs(metric: str, rows: PairedRows) -> tuple[list[tuple[Mapping, Mapping]], tuple[ExcludedDoc, ...]]:
    """The pairs where both runs have the metric's columns, and the documents left out."""
    columns = CORPUS_ITEMS.get(metric, (metric,))
    kept, excluded = [], []
    for base, cand in rows.pairs:
        base_missing, cand_missing = _why_unscored(base, columns), _why_unscored(cand, columns)
        if base_missing is None and cand_missing is None:
            kept.append((base, cand))
            continue
        failed_in = "both" if base_missing and cand_missing else "base" if base_missing else "candidate"
        excluded.append(ExcludedDoc(base["doc_id"], failed_in, base_missing or cand_missing))
    return kept, tuple(excluded)


def _why_unscored(row: Mapping, columns: Sequence[str]) -> str | None:
    if row.get("error") is not None:
        return str(row["error"])
    missing = [c for c in columns if row.get(c) is None or (isinstance(row[c], float) and math.isnan(row[c]))]
    return f"no {', '.join(missing)} value" if missing else None


def _test(key: MetricKey, kept: list[tuple[Mapping, Mapping]],
          options: CompareOptions) -> tuple[Test, tuple[Flip, ...]]:
    if key.metric in CORPUS_ITEMS:
        base_items = metric_items([b for b, _ in kept], key.metric)
        cand_items = metric_items([c for _, c in kept], key.metric)
        test = corpus_test(key.task, key.metric, partial(metric_defs.aggregate, key.metric), base_items, cand_items,
                           metric_defs.METRICS[key.metric].higher_is_better, options.bootstrap_iters, options.seed)
        return test, ()
    base = [float(b[key.metric]) for b, _ in kept]
    cand = [float(c[key.metric]) for _, c in kept]
    test = binary_test(key.task, key.metric, base, cand, [b["group"] for b, _ in kept])
    margins = _margins(key.metric, kept)
    found = flips([b["doc_id"] for b, _ in kept], base, cand, *margins, near_tie=options.near_tie)
    return test, tuple(found)


def _margins(metric: str, kept: list[tuple[Mapping, Mapping]]) -> tuple[list | None, list | None]:
    """Each run's choice_margin per document for a multiple-choice acc; (None, None) where there is none."""
    if metric != "acc" or any(b["kind"] != MULTIPLE_CHOICE for b, _ in kept):
        return None, None
    return ([choice_margin(b["lls"], b["gold"]) for b, _ in kept],
            [choice_margin(c["lls"], c["gold"]) for _, c in kept])
