"""A task YAML's data files turned into the typed documents the pipeline scores, as lm-eval 0.4.13 builds its requests.

Document ids are lm-eval's doc_id (the row's position in the test split, from 0), so our samples line up with
its `--log_samples` output. Few-shot examples are drawn for the first `limit` documents only, in order, with one
seeded sampler (lm-eval's default seed 1234 unless one is given); the seed and the count are recorded. What
each kind scores follows ConfigurableTask.construct_requests: multiple choice scores target_delimiter + choice
after the prompt, log-likelihood scores doc_to_target as is, rolling scores doc_to_target alone (no prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from jinja2 import TemplateError

from layerbus.evals.documents import (
    GENERATION,
    LOGLIKELIHOOD,
    MULTIPLE_CHOICE,
    ROLLING,
    Document,
    TaskFileError,
    TaskProblem,
)
from layerbus.evals.task_data import read_data_file
from layerbus.evals.task_rows import check_row, show
from layerbus.evals.task_yaml import (
    TaskYaml,
    TaskYamlError,
    answer_text,
    choices_of,
    context_of,
    fewshot_examples,
    parse_task_yaml,
    render,
    target_of,
    target_value,
    text_of,
)

# lm-eval's default few-shot seed (lm_eval.defaults.DEFAULT_OTHER_SEED) and generation budget.
DEFAULT_FEWSHOT_SEED = 1234
DEFAULT_MAX_GEN_TOKS = 256
# What a template or a literal in a doc_to_* key can raise on a user's row.
_RENDER_ERRORS = (TemplateError, ValueError, SyntaxError, TypeError, IndexError, KeyError, AttributeError)


@dataclass(frozen=True)
class YamlTask:
    """The documents of a task YAML, with what is needed to reproduce them."""

    # Path of the YAML file as given.
    source: str
    # The parsed YAML (its raw keys go into the results JSON's configs).
    task: TaskYaml
    # output_type; every document is of this kind.
    kind: str
    # The first `limit` documents of the test split, in file order, ids "0", "1", ...
    docs: tuple[Document, ...]
    # Documents in the test split before --limit.
    n_original: int
    # Few-shot examples per document, and the seed of the sampler that drew them.
    num_fewshot: int
    fewshot_seed: int

    def config(self) -> dict:
        """The task's configuration as run, for the results JSON."""
        return {**self.task.raw, "num_fewshot": self.num_fewshot, "fewshot_seed": self.fewshot_seed}


def load_task_yaml(path: str | Path) -> TaskYaml:
    """Parse the YAML at path; its data_files become paths relative to the YAML's folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TaskYamlError(f"{path}: cannot read: {e.strerror or e}") from None
    task = parse_task_yaml(text, str(path))
    files = {split: str(path.parent / file) for split, file in task.data_files.items()}
    return replace(task, data_files=files)


def task_docs(task: TaskYaml, source: str, limit: int | None = None, num_fewshot: int | None = None,
              seed: int | None = None) -> YamlTask:
    """The task's documents; raises TaskFileError with `file:line` for every row that cannot be built."""
    shots = task.num_fewshot if num_fewshot is None else num_fewshot
    seed = DEFAULT_FEWSHOT_SEED if seed is None else seed
    if shots and task.fewshot_split is None:
        raise TaskYamlError(f"{source}: {shots} few-shot examples asked for but the YAML names no fewshot_split; "
                            "add one, or run with --num-fewshot 0")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of documents, got {limit}")
    test_file = task.data_files[task.test_split]
    test_rows = read_data_file(Path(test_file), task.dataset_path)
    rows = test_rows[:limit]
    same_split = task.fewshot_split == task.test_split
    pool_rows = [] if not shots else test_rows if same_split else \
        read_data_file(Path(task.data_files[task.fewshot_split]), task.dataset_path)
    problems = [TaskProblem(task.data_files[task.fewshot_split], line, reason)
                for line, row in pool_rows for reason in _example_problems(task, row)]
    if problems:
        raise TaskFileError(problems)
    examples = fewshot_examples([row for _, row in pool_rows], [row for _, row in rows], shots, seed, same_split)
    docs = []
    for index, ((line, row), shown) in enumerate(zip(rows, examples)):
        doc, reasons = _document(task, str(index), row, shown)
        problems += [TaskProblem(test_file, line, reason) for reason in reasons]
        docs.append(doc)
    if problems:
        raise TaskFileError(problems)
    return YamlTask(source=source, task=task, kind=task.output_type, docs=tuple(docs),
                    n_original=len(test_rows), num_fewshot=shots, fewshot_seed=seed)


def _example_problems(task: TaskYaml, row: dict) -> list[str]:
    """Why a few-shot example cannot be shown (its question or its answer does not render)."""
    reasons = _rendered("doc_to_text", text_of, task, row)[1]
    return reasons + ([] if reasons else _rendered("doc_to_target", answer_text, task, row)[1])


def _rendered(key: str, function, task: TaskYaml, row: dict) -> tuple[object, list[str]]:
    try:
        return function(task, row), []
    except _RENDER_ERRORS as e:
        return None, [f"{key}: {type(e).__name__}: {e}"]


def _document(task: TaskYaml, doc_id: str, row: dict, shown: list[dict]) -> tuple[Document | None, list[str]]:
    text, reasons = _rendered("doc_to_text", text_of, task, row)
    if isinstance(text, int):
        reasons.append(f"doc_to_text gives the integer {text}: lm-eval reads that as a multiple-input task "
                       "(one context per choice), which layerbus does not run; make doc_to_text a text")
    if task.description:
        reasons += _rendered("description", lambda t, r: render(t.description, r), task, row)[1]
    target, target_reasons = _rendered("doc_to_target", target_value, task, row)
    reasons += target_reasons
    if reasons:
        return None, reasons
    context = context_of(task, row, shown)
    if task.output_type == MULTIPLE_CHOICE:
        return _multiple_choice(task, doc_id, row, context)
    if task.output_type == LOGLIKELIHOOD:
        return check_row({"id": doc_id, "context": context, "continuation": _text(target)}, LOGLIKELIHOOD)
    if task.output_type == ROLLING:
        return check_row({"id": doc_id, "text": _text(target)}, ROLLING)
    return _generation(task, doc_id, context, target)


def _multiple_choice(task: TaskYaml, doc_id: str, row: dict, context: str) -> tuple[Document | None, list[str]]:
    choices, reasons = _rendered("doc_to_choice", choices_of, task, row)
    if reasons and isinstance(task.doc_to_choice, str) and task.doc_to_choice not in row:
        rendered, render_reasons = _rendered("doc_to_choice", lambda t, r: render(t.doc_to_choice, r), task, row)
        if not render_reasons:
            reasons = [f"doc_to_choice renders {show(rendered)}, which is not a list literal like ['a', 'b']"]
    if reasons:
        return None, reasons
    if not isinstance(choices, list):
        return None, [f"doc_to_choice must give a list of choices, got {show(choices)}"]
    gold = target_of(task, row, choices)
    if gold == -100:
        return None, [f"doc_to_target gives {show(target_value(task, row))}, which is none of the choices "
                      f"{show(choices)}; give its index or its exact text"]
    doc, reasons = check_row({"id": doc_id, "context": context, "choices": choices, "gold": gold}, MULTIPLE_CHOICE)
    if doc is None:
        return None, [f"as built from the YAML: {reason}" for reason in reasons]
    return replace(doc, target_delimiter=task.target_delimiter), []


def _generation(task: TaskYaml, doc_id: str, context: str, target: object) -> tuple[Document | None, list[str]]:
    kwargs = task.generation_kwargs
    until = kwargs.get("until", [task.fewshot_delimiter])  # lm-eval's default stop string
    targets = [_text(t) for t in target] if isinstance(target, list) else [_text(target)]
    row = {"id": doc_id, "prompt": context, "targets": targets, "until": [until] if isinstance(until, str) else until,
           "max_gen_toks": kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)}
    doc, reasons = check_row(row, GENERATION)
    return (doc, []) if doc is not None else (None, [f"as built from the YAML: {reason}" for reason in reasons])


def _text(value: object) -> str:
    """A target as lm-eval would put it in a request: strings as they are, anything else as its str()."""
    return value if isinstance(value, str) else str(value)

