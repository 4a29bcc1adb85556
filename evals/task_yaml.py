"""The subset of lm-evaluation-harness task YAML layerbus runs offline: a local dataset, Jinja2 prompts, few-shot, filters.

Supported: task, output_type, dataset_path (json | parquet | csv) with data_files (lm-eval's
`dataset_kwargs: {data_files: ...}`, or `data_files` at the top level), test_split, fewshot_split,
doc_to_text / doc_to_target / doc_to_choice (Jinja2, sandboxed; or a column name; doc_to_choice also a list),
target_delimiter, fewshot_delimiter, description, num_fewshot, metric_list, generation_kwargs, filter_list
(regex, take_first, lowercase, remove_whitespace), metadata. Anything else is refused with one message that
names the key and the way out. Few-shot examples: lm-eval's ContextSampler — one random.Random(seed) for the
whole task, rnd.sample(pool, n) per document in order (n + 1 with the document itself removed when the few-shot
split is the test split). The context is description + (q + target_delimiter + a + fewshot_delimiter) per
example + q, the plain-text layout of lm-eval 0.4.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from jinja2 import StrictUndefined
from jinja2.sandbox import SandboxedEnvironment

SUPPORTED_KEYS = (
    "task", "output_type", "dataset_path", "dataset_kwargs", "data_files", "test_split", "fewshot_split", "doc_to_text",
    "doc_to_target", "doc_to_choice", "target_delimiter", "fewshot_delimiter", "description", "num_fewshot",
    "metric_list", "generation_kwargs", "filter_list", "metadata",
)
# Keys people bring from lm-eval that we do not run, and what to do instead.
REFUSED_KEYS = {
    "dataset_name": "hub datasets are not fetched: export the split to a local file and use dataset_path: json "
                    "(or parquet, csv) with data_files",
    "process_docs": "Python hooks are not run: preprocess the documents into the data file",
    "process_results": "Python hooks are not run: use metric_list with acc, acc_norm, exact_match or a perplexity",
    "group": "groups are not supported: list the tasks in a suite file",
    "tag": "tags are not supported: list the tasks in a suite file",
    "class": "custom task classes are not run: describe the task with the supported keys",
    "validation_split": "name the split to score test_split (and few-shot examples fewshot_split)",
    "training_split": "name the few-shot split fewshot_split",
    "fewshot_config": "only the default sampler is supported: give num_fewshot and fewshot_split",
    "use_prompt": "promptsource prompts are not supported: write doc_to_text as a Jinja2 template",
    "should_decontaminate": "decontamination is not supported: remove the key",
    "doc_to_decontamination_query": "decontamination is not supported: remove the key",
    "repeats": "repeats are not supported: remove the key (one generation per document)",
}
OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until")
DATASET_PATHS = ("json", "parquet", "csv")
FILTERS = ("regex", "take_first", "lowercase", "remove_whitespace")


class FunctionTag(str):
    """A `!function` value, kept so the refusal can name the key it sits under."""


class _TaskLoader(yaml.SafeLoader):
    """yaml.safe_load that reads `!function x.y` as a FunctionTag instead of failing on the unknown tag."""


_TaskLoader.add_constructor("!function", lambda loader, node: FunctionTag(loader.construct_scalar(node)))


class TaskYamlError(ValueError):
    """The YAML cannot be run; the message names every offending key."""


@dataclass(frozen=True)
class FilterStep:
    """One step of a filter_list pipeline, as lm-eval names it."""

    # regex, take_first, lowercase or remove_whitespace.
    function: str
    # regex only: the pattern, which match to take (group_select) and what to answer when nothing matches.
    regex_pattern: str = r"#### (\-?[0-9\.\,]+)"
    group_select: int = 0
    fallback: str = "[invalid]"


@dataclass(frozen=True)
class TaskYaml:
    """A checked task YAML; documents are built from rows by task_docs."""

    name: str
    output_type: str
    dataset_path: str
    # Split name -> local file path.
    data_files: dict[str, str]
    test_split: str
    fewshot_split: str | None
    doc_to_text: object
    doc_to_target: object
    doc_to_choice: object
    target_delimiter: str
    fewshot_delimiter: str
    description: str
    num_fewshot: int
    metric_list: tuple[dict, ...]
    generation_kwargs: dict
    # Filter name -> steps (lm-eval's filter_list entries).
    filters: dict[str, tuple[FilterStep, ...]] = field(default_factory=dict)
    # The YAML as read, recorded in the results JSON's configs.
    raw: dict = field(default_factory=dict)


def yaml_task_name(path: Path) -> str | None:
    """The `task:` field of a task YAML file, as lm-eval names the task by it; None where the file has none (or
    is not a readable mapping: loading the task says what is wrong with it)."""
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskLoader)  # noqa: S506 - see parse_task_yaml
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    name = config.get("task") if isinstance(config, dict) else None
    return name if isinstance(name, str) and name else None


def parse_task_yaml(text: str, source: str = "<task yaml>") -> TaskYaml:
    """Check a task YAML; raises TaskYamlError naming every unsupported key or bad value."""
    try:
        config = yaml.load(text, Loader=_TaskLoader)  # noqa: S506 - a SafeLoader subclass with one extra tag
    except yaml.YAMLError as e:
        raise TaskYamlError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(config, dict):
        raise TaskYamlError(f"{source}: expected a mapping of task keys, got {type(config).__name__}")
    problems = _key_problems(config)
    output_type = config.get("output_type", "generate_until")
    if output_type not in OUTPUT_TYPES:
        problems.append(f"output_type {output_type!r} is not one of {', '.join(OUTPUT_TYPES)}")
    if config.get("dataset_path") not in DATASET_PATHS:
        problems.append(f"dataset_path {config.get('dataset_path')!r}: give one of {', '.join(DATASET_PATHS)} "
                        "(local files named in data_files); hub datasets are not fetched")
    data_files, data_problems = _data_files(config)
    problems += data_problems
    test_split = config.get("test_split", next(iter(data_files), "test"))
    if data_files and test_split not in data_files:
        problems.append(f"test_split {test_split!r} is not in data_files ({', '.join(data_files)})")
    num_fewshot = config.get("num_fewshot", 0)
    if not isinstance(num_fewshot, int) or num_fewshot < 0:
        problems.append(f"num_fewshot must be an integer >= 0, got {num_fewshot!r}")
    fewshot_split = config.get("fewshot_split")
    if num_fewshot and fewshot_split not in data_files:
        problems.append(f"num_fewshot is {num_fewshot}: name the examples' split in fewshot_split "
                        f"(one of {', '.join(data_files) or 'data_files'})")
    filters, filter_problems = _filters(config.get("filter_list", []))
    problems += filter_problems
    if problems:
        raise TaskYamlError(f"{source}: " + f"\n{source}: ".join(problems))
    return TaskYaml(
        name=str(config.get("task", source)), output_type=output_type, dataset_path=config["dataset_path"],
        data_files={k: str(v) for k, v in data_files.items()}, test_split=test_split, fewshot_split=fewshot_split,
        doc_to_text=config.get("doc_to_text"), doc_to_target=config.get("doc_to_target"),
        doc_to_choice=config.get("doc_to_choice"), target_delimiter=config.get("target_delimiter", " "),
        fewshot_delimiter=config.get("fewshot_delimiter", "\n\n"), description=config.get("description", ""),
        num_fewshot=num_fewshot, metric_list=tuple(config.get("metric_list", [])),
        generation_kwargs=dict(config.get("generation_kwargs") or {}), filters=filters, raw=config,
    )


def _data_files(config: dict) -> tuple[dict[str, str], list[str]]:
    """Split name -> file, from lm-eval's dataset_kwargs.data_files or a top-level data_files (not both)."""
    kwargs = config.get("dataset_kwargs")
    if kwargs is not None and (not isinstance(kwargs, dict) or set(kwargs) - {"data_files"}):
        other = sorted(set(kwargs) - {"data_files"}) if isinstance(kwargs, dict) else kwargs
        return {}, [f"dataset_kwargs: only data_files is read, got {other!r}; remove the other keys"]
    if kwargs is not None and "data_files" in config:
        return {}, ["data_files is given twice (top level and in dataset_kwargs); keep one"]
    data_files = (kwargs or {}).get("data_files", config.get("data_files"))
    if isinstance(data_files, str):
        data_files = {"train": data_files}
    if not isinstance(data_files, dict) or not data_files:
        return {}, ["data_files: give the local file of each split, e.g. {test: questions.jsonl}"]
    lists = [split for split, path in data_files.items() if not isinstance(path, str)]
    if lists:
        return {}, [f"data_files: split(s) {', '.join(map(str, lists))} must name one file each (a path string); "
                    "join several files into one"]
    return data_files, []


def _key_problems(config: dict) -> list[str]:
    problems = []
    for key, value in config.items():
        if _has_function_tag(value):
            problems.append(f"{key}: !function hooks are not run (layerbus never imports task code); "
                            "write it as a Jinja2 template or preprocess the data file")
        elif key in REFUSED_KEYS:
            problems.append(f"{key} is not supported: {REFUSED_KEYS[key]}")
        elif key not in SUPPORTED_KEYS:
            problems.append(f"{key} is not supported; supported keys: {', '.join(SUPPORTED_KEYS)}")
    return problems


def _has_function_tag(value: object) -> bool:
    if isinstance(value, FunctionTag):
        return True
    if isinstance(value, dict):
        return any(_has_function_tag(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_function_tag(v) for v in value)
    return False


def _filters(filter_list: object) -> tuple[dict[str, tuple[FilterStep, ...]], list[str]]:
    if not isinstance(filter_list, list):
        return {}, [f"filter_list must be a list of {{name, filter}} entries, got {filter_list!r}"]
    filters, problems = {}, []
    for entry in filter_list:
        steps = []
        for step in (entry or {}).get("filter", []):
            function = step.get("function")
            if function not in FILTERS:
                problems.append(f"filter_list: filter {function!r} is not supported; supported: {', '.join(FILTERS)}")
                continue
            steps.append(FilterStep(function, **{k: v for k, v in step.items() if k != "function"}))
        filters[str(entry.get("name", "none"))] = tuple(steps)
    return filters, problems


def apply_filters(response: str, steps: tuple[FilterStep, ...]) -> str:
    """One generation through a filter pipeline, as lm-eval's RegexFilter, TakeFirst, Lowercase, Whitespace do."""
    for step in steps:
        if step.function == "regex":
            matches = re.findall(step.regex_pattern, response)
            if not matches:
                response = step.fallback
                continue
            match = matches[step.group_select]
            if isinstance(match, tuple):
                match = next((m for m in match if m), step.fallback)
            response = match.strip()
        elif step.function == "lowercase":
            response = response.lower()
        elif step.function == "remove_whitespace":
            response = response.strip()  # lm-eval 0.4.13's WhitespaceFilter strips both ends
        # take_first: one generation per document already
    return response


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    """The one custom Jinja2 filter lm-eval's templates may use (lm_eval.utils.regex_replace)."""
    return re.sub(pattern, repl, string, count=count)


_JINJA = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
_JINJA.filters["regex_replace"] = _regex_replace


def render(spec: object, doc: dict) -> object:
    """A doc_to_* value for one document: a column name, a Jinja2 template, or a literal (list, int)."""
    if isinstance(spec, str):
        if spec in doc:
            return doc[spec]
        return _JINJA.from_string(spec).render(**doc)
    return spec


# What follows reads doc_to_text / doc_to_choice / doc_to_target as ConfigurableTask does in lm-eval 0.4.13
# (api/task.py), including its coercions, so a prompt built here is byte-identical to the one it builds.


def text_of(task: TaskYaml, doc: dict) -> object:
    """doc_to_text: a string, or an int where a digit-only rendering meets doc_to_choice (lm-eval's multiple input)."""
    if isinstance(task.doc_to_text, int):
        return task.doc_to_text
    value = render(task.doc_to_text, doc)
    is_template = isinstance(task.doc_to_text, str) and task.doc_to_text not in doc
    if is_template and value.isdigit() and task.doc_to_choice is not None:
        return ast.literal_eval(value)
    return value


def choices_of(task: TaskYaml, doc: dict) -> list[str]:
    """doc_to_choice: a column, a template rendering a Python list literal, a list, or a dict (its values)."""
    spec = task.doc_to_choice
    if isinstance(spec, dict):
        return list(spec.values())
    if isinstance(spec, str) and spec not in doc:
        return ast.literal_eval(render(spec, doc))
    return render(spec, doc)


def target_value(task: TaskYaml, doc: dict) -> object:
    """doc_to_target as lm-eval returns it: an int, a string, or a list (a rendered "[...]" is read as a literal)."""
    spec = task.doc_to_target
    if not isinstance(spec, str) or spec in doc:
        return render(spec, doc)
    value = render(spec, doc)
    if value.isdigit() and task.doc_to_choice is not None:
        return ast.literal_eval(value)
    if len(value) >= 2 and value[0] == "[" and value[-1] == "]":
        try:
            return ast.literal_eval(value)
        except (SyntaxError, ValueError):
            return value
    return value


def target_of(task: TaskYaml, doc: dict, choices: list[str] | None) -> object:
    """The target for scoring: for multiple choice an index (or list of indices) as lm-eval's process_results
    reads it (a choice's text becomes its index; -100 where it names no choice), otherwise the target value."""
    value = target_value(task, doc)
    if choices is None:
        return value
    if isinstance(value, str):
        return choices.index(value) if value in choices else -100
    return value


def answer_text(task: TaskYaml, doc: dict) -> str | None:
    """A few-shot example's answer as lm-eval writes it (build_qa_turn): the gold choice's text, the first of
    several targets, or the target itself; None when the example has no answer (None or "")."""
    value = target_value(task, doc)
    if value is None or value == "":
        return None
    choices = choices_of(task, doc) if task.doc_to_choice is not None else None
    if choices and isinstance(value, int):
        return choices[value]
    return value[0] if isinstance(value, list) else value


def fewshot_examples(pool: list[dict], docs: list[dict], n: int, seed: int, same_split: bool) -> list[list[dict]]:
    """Few-shot examples for each document in order, drawn as lm-eval's ContextSampler draws them."""
    rnd, out = random.Random(seed), []
    for doc in docs:
        if n == 0:
            out.append([])
        elif not same_split:
            out.append(rnd.sample(pool, n))
        else:
            picked = [x for x in rnd.sample(pool, n + 1) if x != doc][:n]
            if len(picked) < n:
                picked = rnd.sample([x for x in pool if x != doc], n)
            out.append(picked)
    return out


def context_of(task: TaskYaml, doc: dict, examples: list[dict]) -> str:
    """The prompt lm-eval 0.4.13's ConfigurableTask.fewshot_context builds as plain text (no chat template).

    The description is rendered against the document (a template, or a column name); each example is its
    question, target_delimiter, answer, fewshot_delimiter (an example without an answer adds neither
    delimiter); then the document's question, with nothing after it.
    """
    parts = [str(render(task.description, doc)) if task.description else ""]
    for example in examples:
        question, answer = str(text_of(task, example)), answer_text(task, example)
        parts.append(question if answer is None else f"{question}{task.target_delimiter}{answer}{task.fewshot_delimiter}")
    parts.append(str(text_of(task, doc)))
    return "".join(parts)
