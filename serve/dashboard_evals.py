"""The dashboard's eval pages: the suites, a suite's history (each metric over its runs with 95% intervals, a
dashed line where what was run changed, each point a link to the compare with the run before it), and the compare
of two runs: each metric's paired test and the documents that flipped, with their margins."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from html import escape
from pathlib import Path
from urllib.parse import quote, urlencode

from layerbus.serve.svg_charts import RunPoint, interval_chart
from layerbus.storage.eval_records import EvalMetric, EvalRun


def suites_page(runs: Sequence[EvalRun]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for run in runs:
        counts[run.suite] += 1
    if not counts:
        return '<p class="muted">No finished eval runs yet: <code>layerbus eval run --suite NAME</code>.</p>'
    rows = "".join(f'<tr class="suite"><td><a href="/evals/history?{urlencode({"suite": suite})}">'
                   f'{escape(suite or "(ad-hoc tasks)")}</a></td><td>{count}</td></tr>'
                   for suite, count in sorted(counts.items()))
    return f"<table><tr><th>suite</th><th>runs</th></tr>{rows}</table>"


def history_page(suite: str, history: Sequence[tuple[EvalRun, list[EvalMetric]]]) -> str:
    """One chart per (task, metric, filter), runs oldest first."""
    if not history:
        return f'<p class="muted">No finished runs of suite {escape(suite)!s}.</p>'
    series: dict[tuple[str, str, str], list[RunPoint]] = defaultdict(list)
    previous: EvalRun | None = None
    for run, metrics in history:
        changed = previous is not None and previous.fingerprint_hash != run.fingerprint_hash
        href = "#" if previous is None else "/evals/compare?" + urlencode({"base": previous.job_id, "cand": run.job_id})
        for m in metrics:
            if m.value is None:
                continue
            spread = "" if m.stderr is None else f" ± {1.96 * m.stderr:.4f}"
            series[(m.task, m.metric, m.filter)].append(RunPoint(
                label=run.created_at.strftime("%m-%d %H:%M"), value=m.value, stderr=m.stderr, href=href,
                new_fingerprint=changed, title=f"{run.job_id}: {m.value:.4f}{spread} (n={m.n})"))
        previous = run
    charts = "".join(f"<h2>{escape(task)} · {escape(metric)}{'' if filt == 'none' else ' · ' + escape(filt)}</h2>"
                     + interval_chart(points, f"{task} {metric}") for (task, metric, filt), points in sorted(series.items()))
    runs = "".join(f'<tr class="run"><td>{escape(run.job_id)}</td><td>{run.created_at:%Y-%m-%d %H:%M}</td>'
                   f"<td>{escape(run.model)}</td><td><code>{escape(run.fingerprint_hash[:12])}</code></td></tr>"
                   for run, _ in history)
    return (f"<p>{len(history)} runs; the bars are 95% intervals, a dashed line marks a change in what was run; click a "
            f"point to compare its run with the one before.</p>{charts}<h2>runs</h2><table><tr><th>job</th><th>created "
            f"(UTC)</th><th>model</th><th>fingerprint</th></tr>{runs}</table>")


def compare_page(base: EvalRun, cand: EvalRun, comparison, changes: Sequence) -> str:  # type: ignore[no-untyped-def]
    """Each compared metric's paired test and its flipped documents, smallest margins first."""
    changed = "".join(f"<li>{escape(c.part)} {escape(c.path)}: {escape(str(c.base))} → {escape(str(c.cand))}</li>"
                      for c in changes)
    parts = [f"<p>base <b>{escape(base.job_id)}</b> ({base.created_at:%Y-%m-%d %H:%M}) against candidate "
             f"<b>{escape(cand.job_id)}</b> ({cand.created_at:%Y-%m-%d %H:%M})</p>",
             f"<h2>what changed</h2><ul>{changed}</ul>" if changed else "<p class=\"muted\">The same fingerprint.</p>"]
    for m in comparison.metrics:
        r = m.row
        parts.append(f"<h2>{escape(m.key.task)} · {escape(m.key.metric)}</h2><p class=\"metric\">{r.base:.4f} → "
                     f"{r.cand:.4f} (diff {r.diff:+.4f}, 95% [{r.low:+.4f}, {r.high:+.4f}]), p (Holm) {r.p_holm:.3g}: "
                     f"<b>{escape(r.verdict)}</b>; n={m.n}, {m.gained} gained, {m.lost} lost</p>")
        if m.flips:
            rows = "".join(f'<tr class="flip"><td>{escape(f.doc_id)}</td><td>{"gained" if f.gained else "lost"}</td>'
                           f"<td>{_margin(f.base_margin)}</td><td>{_margin(f.cand_margin)}</td>"
                           f"<td>{'near tie' if f.near_tie else ''}</td></tr>" for f in m.flips)
            parts.append("<table><tr><th>document</th><th>flip</th><th>base margin</th><th>candidate margin</th><th></th>"
                         f"</tr>{rows}</table>")
    for s in comparison.skipped:
        parts.append(f"<p class=\"muted\">{escape(s.key.task)} {escape(s.key.metric)} not compared: {escape(s.reason)}</p>")
    return "".join(parts)


def read_comparison(store, base_id: str, cand_id: str):  # type: ignore[no-untyped-def]
    """(base, cand, comparison, fingerprint changes) of two finished runs; ValueError saying why they cannot be."""
    from layerbus.evals.compare_runs import CompareOptions, MetricKey, compare_runs
    from layerbus.evals.doc_results import read_samples
    from layerbus.evals.fingerprint_diff import fingerprint_changes
    from layerbus.evals.run_pairs import NotComparableError, check_comparable

    base, cand = store.eval_run(base_id), store.eval_run(cand_id)
    for run in (base, cand):
        if run.samples_path is None or not Path(run.samples_path).is_file():
            raise ValueError(f"eval run {run.job_id} has no samples file: `layerbus eval run --job {run.job_id}` "
                             "writes it")
    base_rows, cand_rows = read_samples(base.samples_path), read_samples(cand.samples_path)
    try:
        check_comparable(base_rows, cand_rows, base.job_id, cand.job_id)
    except NotComparableError as error:
        raise ValueError(str(error)) from None
    keys = [[MetricKey(m.task, m.metric, m.filter) for m in store.eval_metrics(run.job_id)] for run in (base, cand)]
    comparison = compare_runs(base_rows, cand_rows, keys[0], keys[1], CompareOptions())
    return base, cand, comparison, fingerprint_changes(base.fingerprint_json, cand.fingerprint_json)


def _margin(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


def suite_link(suite: str) -> str:
    return "/evals/history?suite=" + quote(suite)
