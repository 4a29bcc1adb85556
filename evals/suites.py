"""An eval suite file (TOML): the tasks a nightly run scores, with their metrics, few-shot count and seed.

    name = "nightly"                 # names the suite's runs (eval history NAME); letters, digits, - _ .
    seed = 1234                      # few-shot sampler seed; lm-eval's default when left out
    num_fewshot = 0                  # default few-shot examples for task YAML entries

    [[tasks]]
    name = "everyday-mc"             # unique within the suite; the task's key in results
    path = "everyday_mc.jsonl"       # a task file, a folder of .txt files, or a task .yaml; relative to this file
    metrics = ["acc", {metric = "acc_norm"}]   # names, or tables with lm-eval metric_list options
    num_fewshot = 2                  # task YAML only; overrides the suite's

load_suite checks the file alone; load_suite_tasks reads every task through its reader and checks each metric
against the task's kind. Both report every problem at once, each as `file: message` naming the field.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

from layerbus.evals.documents import (
    GENERATION,
    KIND_NAMES,
    LOGLIKELIHOOD,
    MULTIPLE_CHOICE,
    ROLLING,
    Document,
    TaskFileError,
)
from layerbus.evals.task_files import load_task_file
from layerbus.evals.task_yaml import FilterStep, TaskYamlError
from layerbus.evals.yaml_docs import DEFAULT_FEWSHOT_SEED, load_task_yaml, task_docs

SUITE_KEYS = ("name", "seed", "num_fewshot", "tasks")
TASK_KEYS = ("name", "path", "metrics", "num_fewshot")
# Metrics each kind of document can give, the first ones being lm-eval's defaults for that output_type.
KIND_METRICS = {
    MULTIPLE_CHOICE: ("acc", "acc_norm"),
    LOGLIKELIHOOD: ("perplexity", "acc"),
    ROLLING: ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    GENERATION: ("exact_match",),
}
# Options a metric entry may carry (lm-eval's exact_match keywords); the others take none.
METRIC_OPTIONS = {"exact_match": ("ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore")}
ALL_METRICS = tuple(dict.fromkeys(m for metrics in KIND_METRICS.values() for m in metrics))
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class SuiteError(ValueError):
    """A suite cannot be run; the message has one `file: message` line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class MetricSpec:
    """One metric of a task, with its lm-eval options (exact_match's ignore_case...)."""

    name: str
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SuiteTask:
    """One [[tasks]] entry, checked."""

    # Unique within the suite.
    name: str
    # Resolved against the suite file's folder.
    path: Path
    # Empty: the task YAML's metric_list, or the kind's defaults.
    metrics: tuple[MetricSpec, ...]
    # None: the suite's num_fewshot (task YAML), 0 for task files.
    num_fewshot: int | None


@dataclass(frozen=True)
class Suite:
    """A checked suite file."""

    source: str
    name: str
    seed: int
    num_fewshot: int
    tasks: tuple[SuiteTask, ...]


@dataclass(frozen=True)
class LoadedTask:
    """A suite task's documents, whatever reader they came through."""

    name: str
    kind: str
    docs: tuple[Document, ...]
    # Documents before --limit.
    n_original: int
    metrics: tuple[MetricSpec, ...]
    num_fewshot: int
    fewshot_seed: int
    # The task's configuration as run, for the results JSON.
    config: dict
    # A task YAML's filter_list: filter name -> steps applied to each generation before exact_match. Empty: lm-eval's
    # default, the generation as is under the filter name "none".
    filters: dict[str, tuple[FilterStep, ...]] = field(default_factory=dict)


def load_suite(path: str | Path) -> Suite:
    """Read and check the suite file; raises SuiteError naming every problem."""
    import tomllib

    source, path = str(path), Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SuiteError([f"{source}: cannot read: {e.strerror or e}"]) from None
    except tomllib.TOMLDecodeError as e:
        raise SuiteError([f"{source}: not valid TOML: {e}"]) from None
    problems = _unknown(data, SUITE_KEYS, "", source)
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        problems.append(f"{source}: name must be a string of letters, digits, '-', '_' or '.', got {name!r}; "
                        'add name = "nightly"')
    seed = data.get("seed", DEFAULT_FEWSHOT_SEED)
    problems += _count(seed, "seed", source)
    num_fewshot = data.get("num_fewshot", 0)
    problems += _count(num_fewshot, "num_fewshot", source)
    entries = data.get("tasks")
    if not isinstance(entries, list) or not entries:
        problems.append(f"{source}: tasks: give at least one [[tasks]] table with name, path and metrics")
        entries = []
    tasks = [_task(entry, i, path.parent, source, problems) for i, entry in enumerate(entries, start=1)]
    names = [t.name for t in tasks if t is not None]
    for repeated in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{source}: tasks: the name {repeated!r} is used twice; task names key the results")
    if problems:
        raise SuiteError(problems)
    return Suite(source, name, seed, num_fewshot, tuple(tasks))


def _task(entry: object, number: int, folder: Path, source: str, problems: list[str]) -> SuiteTask | None:
    where = f"tasks[{number}]"
    if not isinstance(entry, dict):
        problems.append(f"{source}: {where} must be a table ([[tasks]]), got {entry!r:.40}")
        return None
    where = f"tasks[{number}] ({entry['name']!r})" if isinstance(entry.get("name"), str) else where
    found = _unknown(entry, TASK_KEYS, f"{where}: ", source)
    if not isinstance(entry.get("name"), str) or not _NAME.match(entry["name"]):
        found.append(f"{source}: {where}: name must be letters, digits, '-', '_' or '.', got {entry.get('name')!r}")
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        found.append(f"{source}: {where}: path: give the task file, .txt folder or task .yaml, relative to {source}")
    elif not (folder / path).exists():
        found.append(f"{source}: {where}: path {path!r} does not exist (looked for {folder / path}); "
                     "paths are relative to the suite file")
    metrics = entry.get("metrics", [])
    if not isinstance(metrics, list):
        found.append(f'{source}: {where}: metrics must be a list, e.g. ["acc", "acc_norm"]')
        metrics = []
    metrics = [_metric(m, f"{where}: metrics", source, found) for m in metrics]
    if "num_fewshot" in entry:
        found += _count(entry["num_fewshot"], f"{where}: num_fewshot", source)
    problems += found
    if found:
        return None
    return SuiteTask(entry["name"], folder / path, tuple(metrics), entry.get("num_fewshot"))


def _metric(value: object, where: str, source: str, problems: list[str]) -> MetricSpec | None:
    if isinstance(value, str):
        value = {"metric": value}
    if not isinstance(value, dict) or not isinstance(value.get("metric"), str):
        problems.append(f"{source}: {where}: each entry is a metric name or a table with metric = NAME, got {value!r}")
        return None
    name, options = value["metric"], {k: v for k, v in value.items() if k != "metric"}
    if name not in ALL_METRICS:
        close = difflib.get_close_matches(name, ALL_METRICS, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"{source}: {where}: unknown metric {name!r}{hint}; known: {', '.join(ALL_METRICS)}")
        return None
    unknown = sorted(set(options) - set(METRIC_OPTIONS.get(name, ())))
    if unknown:
        accepted = ", ".join(METRIC_OPTIONS.get(name, ())) or "none"
        problems.append(f"{source}: {where}: {name} has no option(s) {', '.join(unknown)}; accepted: {accepted}")
        return None
    return MetricSpec(name, options)


def _unknown(table: dict, accepted: tuple[str, ...], where: str, source: str) -> list[str]:
    problems = []
    for key in table:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{source}: {where}unknown key {key!r}{hint}; accepted: {', '.join(accepted)}")
    return problems


def _count(value: object, key: str, source: str) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return [f"{source}: {key} must be an integer >= 0, got {value!r}"]
    return []


def load_suite_tasks(suite: Suite, limit: int | None = None) -> tuple[LoadedTask, ...]:
    """Every task of the suite through its reader; raises SuiteError with every task's problems."""
    loaded, problems = [], []
    for task in suite.tasks:
        try:
            loaded.append(_load(suite, task, limit))
        except TaskFileError as e:
            problems += [str(p) for p in e.problems]
        except TaskYamlError as e:
            problems += str(e).splitlines()
        except ValueError as e:  # a metric that does not fit the task's kind
            problems.append(str(e))
    if problems:
        raise SuiteError(problems)
    return tuple(loaded)


def _load(suite: Suite, task: SuiteTask, limit: int | None) -> LoadedTask:
    if task.path.suffix.lower() in (".yaml", ".yml"):
        yaml_task = load_task_yaml(task.path)
        # The entry's count, else the YAML's own, else the suite's default.
        shots = task.num_fewshot if task.num_fewshot is not None else \
            yaml_task.raw.get("num_fewshot", suite.num_fewshot)
        built = task_docs(yaml_task, str(task.path), limit=limit, num_fewshot=shots, seed=suite.seed)
        # A metric_list entry's lm-eval options (exact_match's ignore_case...) change its scores, so they are kept;
        # its aggregation / higher_is_better keys are lm-eval's registry facts, which metrics.METRICS holds already.
        declared = tuple(MetricSpec(m["metric"], _declared_options(m)) for m in yaml_task.metric_list
                         if isinstance(m, dict))
        kind, docs, n_original, config = built.kind, built.docs, built.n_original, built.config()
        filters = yaml_task.filters
    else:
        if task.num_fewshot:
            raise ValueError(f"{suite.source}: tasks ({task.name!r}): num_fewshot applies to task YAML only; a task "
                             "file's prompts are scored as written: remove the key or write the task as YAML")
        task_file, shots, declared, filters = load_task_file(task.path), 0, (), {}
        kind, docs, n_original = task_file.kind, task_file.docs[:limit], len(task_file.docs)
        config = {"task": task.name, "path": str(task.path), "output_type": kind}
    metrics = task.metrics or declared or tuple(MetricSpec(m) for m in KIND_METRICS[kind])
    wrong = [m.name for m in metrics if m.name not in KIND_METRICS[kind]]
    if wrong:
        raise ValueError(f"{suite.source}: tasks ({task.name!r}): metrics {', '.join(wrong)} do not apply to "
                         f"{KIND_NAMES[kind]} documents; use {', '.join(KIND_METRICS[kind])}")
    return LoadedTask(task.name, kind, docs, n_original, metrics, shots, suite.seed,
                      {**config, "task": task.name, "metric_list": [{"metric": m.name, **m.options} for m in metrics]},
                      filters)


def _declared_options(entry: dict) -> dict:
    """The options of a task YAML metric_list entry that layerbus's metric takes (exact_match's ignore_case...)."""
    return {k: v for k, v in entry.items() if k in METRIC_OPTIONS.get(entry["metric"], ())}
