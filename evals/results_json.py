"""A run's results as lm-evaluation-harness's results JSON, so its tooling (make_table, loggers, leaderboards) reads ours.

Layout of lm-eval 0.4.x (`evaluator_utils.py` _to_eval_results, `evaluator.py` simple_evaluate,
`result_schema.py` EvalResults): `results[task]` holds `name`, `alias`, `sample_len` and one
`"<metric>,<filter>"` / `"<metric>_stderr,<filter>"` pair per metric ("N/A" where there is no standard
error); beside it `group_subtasks`, `configs`, `versions`, `n-shot`, `higher_is_better`,
`n-samples {original, effective}`, and the run's `config` (model, model_args, limit, bootstrap_iters,
gen_kwargs, seeds), `git_hash`, `date`. layerbus's own facts about the run (model fingerprint, stages, wire
codecs) go under `config["layerbus"]`, a key lm-eval's readers ignore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from layerbus.evals.metrics import METRICS

# The filter name lm-eval gives metrics computed on unfiltered outputs.
NO_FILTER = "none"


@dataclass(frozen=True)
class FilterMetrics:
    """A task's metrics under one more filter (a task YAML's filter_list names several, e.g. gsm8k's two)."""

    # The filter_list entry's name.
    filter_name: str
    # Corpus value and standard error per metric name, as TaskResult.metrics / stderrs.
    metrics: dict[str, float]
    stderrs: dict[str, float | None]


@dataclass(frozen=True)
class TaskResult:
    """One task's aggregated metrics, ready for the results JSON."""

    # Task name, the key under results/configs/versions/...
    task: str
    # Corpus value per metric name (acc, bits_per_byte...).
    metrics: dict[str, float]
    # Standard error per metric; None is written as lm-eval's "N/A".
    stderrs: dict[str, float | None]
    # Documents in the task, and documents scored (fewer under --limit).
    n_original: int
    n_effective: int
    # The task's configuration as run (task file or YAML keys, num_fewshot, few-shot seed...).
    config: dict = field(default_factory=dict)
    # Few-shot examples per document.
    num_fewshot: int = 0
    # Task version (a YAML's metadata.version; 0 for a plain task file).
    version: float | str = 0
    # Filter name the metrics were computed under (a YAML filter_list entry's name, or "none").
    filter_name: str = NO_FILTER
    # The same metrics under the task's further filters, written after the first filter's, in this order.
    other_filters: tuple[FilterMetrics, ...] = ()


def task_entry(result: TaskResult) -> dict:
    """results[task]: the metric keys lm-eval's aggregation writes, in its order (value, then stderr)."""
    entry: dict = {"name": result.task, "alias": result.task, "sample_len": result.n_effective}
    for filtered in (FilterMetrics(result.filter_name, result.metrics, result.stderrs), *result.other_filters):
        for metric, value in filtered.metrics.items():
            error = filtered.stderrs.get(metric)
            entry[f"{metric},{filtered.filter_name}"] = value
            entry[f"{metric}_stderr,{filtered.filter_name}"] = "N/A" if error is None else error
    return entry


def metric_names(result: TaskResult) -> list[str]:
    """Every metric the task reports, under any filter, in first-seen order."""
    return list(dict.fromkeys(m for f in (result.metrics, *(o.metrics for o in result.other_filters)) for m in f))


def results_json(tasks: list[TaskResult], run_config: dict, date: float, git_hash: str | None = None,
                 layerbus: dict | None = None) -> dict:
    """The whole results document; run_config holds lm-eval's `config` keys (model, limit, seeds...)."""
    names = [t.task for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names repeat in {names=}: each task is one key of the results JSON")
    config = dict(run_config)
    if layerbus is not None:
        config["layerbus"] = layerbus
    return {
        "results": {t.task: task_entry(t) for t in tasks},
        "group_subtasks": {t.task: [] for t in tasks},
        "configs": {t.task: t.config for t in sorted(tasks, key=lambda t: t.task)},
        "versions": {t.task: t.version for t in sorted(tasks, key=lambda t: t.task)},
        "n-shot": {t.task: t.num_fewshot for t in sorted(tasks, key=lambda t: t.task)},
        "higher_is_better": {
            t.task: {m: METRICS[m].higher_is_better for m in metric_names(t)}
            for t in sorted(tasks, key=lambda t: t.task)
        },
        "n-samples": {t.task: {"original": t.n_original, "effective": t.n_effective} for t in tasks},
        "config": config,
        "git_hash": git_hash,
        "date": date,
    }


def dumps(results: dict) -> str:
    """The JSON text, as lm-eval writes it (indent 2, non-ASCII kept)."""
    return json.dumps(results, indent=2, ensure_ascii=False, default=str)
