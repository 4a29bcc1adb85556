"""What `layerbus eval compare` prints: a table of the compared metrics with the flipped documents and what was
left out (comparison_text), or all of it, every flip included, as JSON (comparison_json)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from layerbus.evals.compare import Flip
    from layerbus.evals.compare_runs import MetricComparison, MetricKey, RunComparison
    from layerbus.evals.fingerprint_diff import FingerprintChange
    from layerbus.storage import EvalRun

# Flipped documents the table shows per task (the JSON has them all), shared among the task's metrics.
FLIPS_PER_TASK = 6
# Failed documents named per metric before "and N more".
NAMED_EXCLUDED = 3
SHORT_HASH = 12


def comparison_text(base: EvalRun, cand: EvalRun, changes: Sequence[FingerprintChange], comparison: RunComparison,
                    fail_on_regression: bool) -> str:
    from layerbus.evals.fingerprint_diff import summary

    lines = [_run_line("base", base), _run_line("candidate", cand),
             f"{'changed':<10} {summary(list(changes)) if changes else 'nothing: same fingerprint'}", ""]
    lines += _table(comparison.metrics) if comparison.metrics else ["no metric in common to compare"]
    flipped = _flips_section(comparison.metrics)
    if flipped:
        lines += ["", f"flipped documents (up to {FLIPS_PER_TASK} per task, losses first, smallest margin first; "
                      "margin: best gold minus best other log-likelihood; ~ near tie; all in --json)", *flipped]
    left_out = _left_out_section(comparison)
    if left_out:
        lines += ["", "left out", *left_out]
    lines += ["", _result_line(comparison, fail_on_regression)]
    return "\n".join(lines)


def _run_line(label: str, run: EvalRun) -> str:
    suite = f"suite {run.suite}" if run.suite else "ad-hoc tasks"
    return (f"{label:<10} {run.job_id}  {_clock(run.created_at)} UTC  {suite}  "
            f"fingerprint {run.fingerprint_hash[:SHORT_HASH]}  {run.model}")


def _table(metrics: Sequence[MetricComparison]) -> list[str]:
    header = ("task", "metric", "base", "cand", "diff", "95% interval", "p", "p Holm", "test", "n", "verdict")
    rows = [header]
    for m in metrics:
        r = m.row
        rows.append((m.key.task, metric_label(m.key), _num(r.base), _num(r.cand), _signed(r.diff),
                     f"[{_signed(r.low)}, {_signed(r.high)}]", _p(r.p), _p(r.p_holm), r.test, str(m.n), r.verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    left = {0, 1, 8, 10}  # text columns; numbers line up on the right
    return ["  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in rows]


def _flips_section(metrics: Sequence[MetricComparison]) -> list[str]:
    by_task: dict[str, list[MetricComparison]] = {}
    for m in metrics:
        if m.flips:
            by_task.setdefault(m.key.task, []).append(m)
    lines = []
    for task, flipped in by_task.items():
        shown_each = max(2, FLIPS_PER_TASK // len(flipped))
        for m in flipped:
            lines.append(f"  {task} {metric_label(m.key)}: {m.gained} gained, {m.lost} lost")
            ordered = sorted(m.flips, key=lambda f: f.gained)  # stable: losses first, each in flips' margin order
            width = max(len(f.doc_id) for f in ordered[:shown_each])
            lines += [f"    {f.doc_id:<{width}}  {'gained' if f.gained else 'lost  '}{_margins(f)}".rstrip()
                      for f in ordered[:shown_each]]
            if len(ordered) > shown_each:
                lines.append(f"    ... and {len(ordered) - shown_each} more")
    return lines


def _margins(flip: Flip) -> str:
    if flip.base_margin is None or flip.cand_margin is None:
        return ""
    return f"  margin {_margin(flip.base_margin)} -> {_margin(flip.cand_margin)}" + \
        ("  ~ near tie" if flip.near_tie else "")


def _margin(value: float) -> str:
    # A near tie's margin is what matters most about it: never round it to "-0.000".
    return f"{value:+.3f}" if value == 0 or abs(value) >= 1e-3 else f"{value:+.1e}"


def _left_out_section(comparison: RunComparison) -> list[str]:
    lines = []
    for m in comparison.metrics:
        if m.excluded:
            named = "; ".join(f"{e.doc_id} in {'both runs' if e.failed_in == 'both' else 'the ' + e.failed_in}: "
                              f"{_short(e.reason)}" for e in m.excluded[:NAMED_EXCLUDED])
            more = f"; and {len(m.excluded) - NAMED_EXCLUDED} more" if len(m.excluded) > NAMED_EXCLUDED else ""
            lines.append(f"  {m.key.task} {metric_label(m.key)}: {len(m.excluded)} failed document(s) left out of "
                         f"both runs ({named}{more})")
    lines += [f"  {s.key.task} {metric_label(s.key)}: not compared, {s.reason}" for s in comparison.skipped]
    return lines


def _result_line(comparison: RunComparison, fail_on_regression: bool) -> str:
    worse = comparison.regressions
    total = len(comparison.metrics)
    effect = f", at least {comparison.options.min_effect:g} in size" if comparison.options.min_effect else ""
    if not worse:
        better = sum(1 for m in comparison.metrics if m.row.verdict == "better")
        return (f"result: no metric significantly worse (of {total}, after Holm's correction{effect}); "
                f"{better} better")
    named = ", ".join(f"{m.key.task} {metric_label(m.key)}" for m in worse)
    gate = "exit 3 (--fail-on-regression)" if fail_on_regression else "--fail-on-regression would exit 3"
    return f"result: {len(worse)} of {total} metric(s) significantly worse after Holm's correction{effect}: " \
           f"{named}; {gate}"


def metric_label(key: MetricKey) -> str:
    return key.metric if key.filter == "none" else f"{key.metric} ({key.filter})"


def comparison_json(base: EvalRun, cand: EvalRun, changes: Sequence[FingerprintChange],
                    comparison: RunComparison) -> dict[str, Any]:
    """Everything the table shows, every flipped and left-out document included; non-finite numbers are null."""
    from dataclasses import asdict

    return {
        "base": _run_json(base),
        "candidate": _run_json(cand),
        "fingerprint_changes": [{"part": c.part, "path": c.path, "base": c.base, "candidate": c.cand}
                                for c in changes],
        "options": asdict(comparison.options),
        "metrics": [_metric_json(m) for m in comparison.metrics],
        "skipped": [{**_key_json(s.key), "reason": s.reason} for s in comparison.skipped],
        "regression": bool(comparison.regressions),
        "regressions": [_key_json(m.key) for m in comparison.regressions],
    }


def _run_json(run: EvalRun) -> dict[str, Any]:
    return {"job_id": run.job_id, "suite": run.suite, "model": run.model, "created_at": run.created_at.isoformat(),
            "fingerprint_hash": run.fingerprint_hash, "samples_path": run.samples_path}


def _key_json(key: MetricKey) -> dict[str, str]:
    return {"task": key.task, "metric": key.metric, "filter": key.filter}


def _metric_json(m: MetricComparison) -> dict[str, Any]:
    r = m.row
    return {
        **_key_json(m.key), "base": _finite(r.base), "candidate": _finite(r.cand), "diff": _finite(r.diff),
        "low": _finite(r.low), "high": _finite(r.high), "p": r.p, "p_holm": r.p_holm, "test": r.test,
        "higher_is_better": r.higher_is_better, "verdict": r.verdict, "n": m.n, "gained": m.gained, "lost": m.lost,
        "excluded": [{"doc_id": e.doc_id, "failed_in": e.failed_in, "reason": e.reason} for e in m.excluded],
        "flips": [{"doc_id": f.doc_id, "gained": f.gained, "base_margin": _finite(f.base_margin),
                   "candidate_margin": _finite(f.cand_margin), "near_tie": f.near_tie} for f in m.flips],
    }  # fmt: skip


def _finite(value: float | None) -> float | None:
    # JSON has no NaN or infinity (a one-choice question's margin is infinite): null instead.
    return value if value is not None and math.isfinite(value) else None


def _num(value: float) -> str:
    return f"{value:.4f}"


def _signed(value: float, digits: int = 4) -> str:
    return f"{value:+.{digits}f}"


def _p(value: float) -> str:
    return "<0.0001" if value < 1e-4 else f"{value:.4f}"


def _short(text: str, limit: int = 80) -> str:
    first = text.splitlines()[0] if text else ""
    return first if len(first) <= limit else first[:limit - 3] + "..."


def _clock(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M")
