"""An eval run from end to end, around the job runner: tasks become a queued job (one item per document)
plus its eval_runs row; a finished job becomes metrics in the store, a samples Parquet file and a
results JSON in lm-evaluation-harness's layout.

Everything finalize needs is in the store: each item's input is its document, and the job's settings
hold each task's kind, metrics and configuration. So a run resumed with `--job`, or finalized by
another machine after `run_cluster.sh` ran it, scores exactly the documents that were queued, even if
the task files changed since.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from layerbus.evals.documents import DOC_TYPES
from layerbus.evals.encoding import Encoder
from layerbus.evals.suites import LoadedTask, MetricSpec, Suite, SuiteTask, load_suite, load_suite_tasks
from layerbus.evals.task_yaml import FilterStep, yaml_task_name
from layerbus.storage import JobSettings, JobStore
from layerbus.storage.eval_records import EvalMetric, EvalRun, canonical_fingerprint

EVAL_TASK = "eval"  # jobs.task of an eval run
SETTINGS_KEY = "eval"  # its entry in JobSettings.extra


@dataclass(frozen=True)
class EvalOptions:
    """What `layerbus eval run` was asked, beyond the cluster."""

    # Task files / folders / YAML given on the command line (used when suite is None).
    task_paths: tuple[str, ...] = ()
    # A suite file.
    suite: Path | None = None
    # Documents per task (the first N); None: all.
    limit: int | None = None
    # Few-shot examples for task YAML entries; None: the suite's (or 0).
    num_fewshot: int | None = None
    # Few-shot sampler seed; None: the suite's (or lm-eval's 1234).
    seed: int | None = None


def select_tasks(options: EvalOptions) -> tuple[Suite, tuple[LoadedTask, ...]]:
    """The suite (a file, or one made of the given tasks) and its tasks, read and checked."""
    if options.suite is not None:
        suite = load_suite(options.suite)
        if options.seed is not None or options.num_fewshot is not None:
            suite = Suite(suite.source, suite.name, suite.seed if options.seed is None else options.seed,
                          suite.num_fewshot if options.num_fewshot is None else options.num_fewshot, suite.tasks)
    else:
        tasks, names = [], set()
        for given in options.task_paths:
            path = Path(given).expanduser()
            # As lm-eval names it: a task YAML by its `task:` field; other files by their stem, folders by name.
            named = yaml_task_name(path) if path.suffix in (".yaml", ".yml") else None
            name = named or (path.stem if path.suffix else path.name)
            while name in names:  # two files of one name in different folders
                name += "_"
            names.add(name)
            tasks.append(SuiteTask(name, path.absolute(), (), None))
        suite = Suite("command line", "", 1234 if options.seed is None else options.seed,
                      options.num_fewshot or 0, tuple(tasks))
    return suite, load_suite_tasks(suite, options.limit)


def task_settings(task: LoadedTask) -> dict:
    """What finalize needs of a task besides its documents (those are the items' inputs)."""
    return {"name": task.name, "kind": task.kind, "n_original": task.n_original,
            "metrics": [{"metric": m.name, **m.options} for m in task.metrics], "num_fewshot": task.num_fewshot,
            "fewshot_seed": task.fewshot_seed, "config": task.config,
            "filters": {name: [asdict(step) for step in steps] for name, steps in task.filters.items()}}


def document_json(doc) -> str:
    return json.dumps(asdict(doc), ensure_ascii=False, sort_keys=True)


def document_from_json(kind: str, text: str):
    fields = json.loads(text)
    for key, value in fields.items():  # JSON has lists where the frozen documents hold tuples
        if isinstance(value, list):
            fields[key] = tuple(value)
    return DOC_TYPES[kind](**fields)


def queue_eval(store: JobStore, model_dir: Path, suite: Suite, tasks: tuple[LoadedTask, ...], encoder: Encoder,
               max_length: int, fingerprint: dict, now: datetime | None = None) -> str:
    """Queue the documents as one job and record the eval run; returns the job id."""
    from layerbus.evals.items import task_items

    items = []
    for task in tasks:
        items += task_items(task, encoder, max_length, start_seq=len(items))
    eval_settings = {"suite": suite.name, "suite_source": suite.source, "max_length": max_length,
                     "tasks": [task_settings(t) for t in tasks]}
    settings = JobSettings(task=EVAL_TASK, model=str(model_dir), name=suite.name or "eval",
                           input_path=suite.source, seed=suite.seed, extra={SETTINGS_KEY: eval_settings})
    job_id = store.create_job(settings, items)
    fingerprint_json, fingerprint_hash = canonical_fingerprint(fingerprint)
    store.record_eval_run(EvalRun(job_id, suite.name, str(model_dir), fingerprint_hash, fingerprint_json,
                                  json.dumps(eval_settings, sort_keys=True), now or datetime.now(timezone.utc)))
    return job_id


def stored_tasks(store: JobStore, job_id: str) -> tuple[list[LoadedTask], list]:
    """The run's tasks rebuilt from the store (documents from the items' inputs), and its items."""
    settings = store.job_settings(job_id)
    eval_settings = settings.extra.get(SETTINGS_KEY)
    if settings.task != EVAL_TASK or eval_settings is None:
        raise ValueError(f"job {job_id} is a {settings.task!r} job, not an eval run: see `layerbus eval history` "
                         "for eval runs")
    docs: dict[str, list] = {t["name"]: [] for t in eval_settings["tasks"]}
    kinds = {t["name"]: t["kind"] for t in eval_settings["tasks"]}
    items = list(store.job_items(job_id))
    for item in items:
        task = item.custom_id.partition("/")[0]
        docs[task].append(document_from_json(kinds[task], item.input))
    tasks = [LoadedTask(t["name"], t["kind"], tuple(docs[t["name"]]), t["n_original"],
                        tuple(MetricSpec(m["metric"], {k: v for k, v in m.items() if k != "metric"})
                              for m in t["metrics"]),
                        t["num_fewshot"], t["fewshot_seed"], t["config"],
                        {name: tuple(FilterStep(**step) for step in steps)
                         for name, steps in t.get("filters", {}).items()})
             for t in eval_settings["tasks"]]
    return tasks, items


@dataclass(frozen=True)
class EvalOutcome:
    """A finalized run: its metrics and files."""

    job_id: str
    metrics: list[EvalMetric]
    samples_path: Path
    results_path: Path


def finalize_eval(store: JobStore, job_id: str, out_dir: Path, layerbus_facts: dict | None = None) -> EvalOutcome:
    """Score the finished documents, write the samples and results files, record the metrics.
    Idempotent: finalizing again rewrites the same files and replaces the metric rows."""
    from layerbus.evals.doc_results import outcomes_by_doc, samples_rows, task_metrics, task_result, write_samples
    from layerbus.evals.results_json import dumps, results_json

    run = store.eval_run(job_id)
    tasks, items = stored_tasks(store, job_id)
    finished = list(store.item_results(job_id))
    folder = Path(out_dir) / job_id
    folder.mkdir(parents=True, exist_ok=True)
    samples, results, metrics = [], [], []
    for task in tasks:
        rows = samples_rows(task, [i for i in items if i.custom_id.startswith(f"{task.name}/")],
                            outcomes_by_doc(task.name, finished))
        samples += rows
        # Failed documents keep their row (with the error) and are left out of the metrics; n says how many counted.
        values = task_metrics(task, rows, allow_failed=True)
        results.append(task_result(task, values))
        metrics += [EvalMetric(task.name, v.metric, v.filter, v.value, v.stderr, v.n) for v in values]
    samples_path = folder / "samples.parquet"
    write_samples(samples_path, samples)
    settings = json.loads(run.settings_json)
    run_config = {"model": "layerbus", "model_args": f"pretrained={run.model}", "limit": None,
                  "bootstrap_iters": 100_000, "gen_kwargs": None, "fewshot_seed": settings.get("fewshot_seed"),
                  "max_length": settings.get("max_length")}
    facts = {"job_id": job_id, "suite": run.suite, "fingerprint": json.loads(run.fingerprint_json),
             "fingerprint_hash": run.fingerprint_hash, **(layerbus_facts or {})}
    results_path = folder / "results.json"
    results_path.write_text(dumps(results_json(results, run_config, time.time(), layerbus=facts)))
    store.finish_eval_run(job_id, str(samples_path), str(results_path), metrics)
    return EvalOutcome(job_id, metrics, samples_path, results_path)
