"""Eval item outputs back into per-document results (the samples file) and a task's metrics, as lm-eval computes them.

The runtime answers a scoring item (items.py) with JSON {"ll", "is_greedy", "tokens"}, one entry per
continuation, and a generation item with its text. Each document's scores come from evals/metrics.py:
multiple_choice_scores (acc, acc_norm), loglikelihood_scores (perplexity, acc), rolling_scores (word/byte
perplexity, bits per byte), exact_match (with the task's MetricSpec options, after each of its YAML filters).

SAMPLES: one row per document and filter, in document order. Only generation tasks have filters of their own (a
task YAML's filter_list, in its order); every other row, and a generation task without filter_list, has filter
"none", lm-eval's name for the unfiltered outputs. Columns (SAMPLE_COLUMNS, samples_schema()):

  task, doc_id, kind, filter, group  the document; group clusters standard errors (null: its own cluster)
  prompt_hash                        what the model was asked (items.prompt_hash); runs compare only when equal
  error                              why the document has no scores; null when it has them
  lls                                log-likelihoods: one per choice (multiple choice), [ll] (log-likelihood),
                                     [sum over windows] (rolling); empty when failed or generation
  is_greedy                          one per entry of lls (rolling: every window greedy)
  tokens                             continuation tokens scored, one per entry of lls (rolling: the text's)
  generated                          generation: the text, cut at the first stop string as lm-eval does
  filtered                           generation: the text after this row's filter
  gold                               multiple choice: the correct choices' indices
  targets                            generation: the accepted answers; log-likelihood: [the continuation]
  acc, acc_norm, exact_match         the 0/1 score of each of these the task reports; null otherwise
  ll, words, bytes                   the corpus metrics' items: ll is the continuation's (log-likelihood) or the
                                     text's (rolling) log-likelihood; words and bytes the rolling text's counts

A corpus metric is recomputed from the rows alone (metric_items): perplexity from [ll], word_perplexity
from [(ll, words)], byte_perplexity and bits_per_byte from [(ll, bytes)]; the 0/1 metrics from their column.
`eval compare` resamples those per-document items, paired by (task, filter, doc_id).

FAILED DOCUMENTS stay visible: a document whose item failed, has no result yet, or whose output is not what
was asked keeps its row, with the reason in error, NaN in each metric column the task reports and in ll,
and empty lls. task_metrics refuses a task with such rows (IncompleteTaskError, naming them) unless
allow_failed is given; then it scores the others and n says how many.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from layerbus.evals import metrics
from layerbus.evals.documents import (
    GENERATION,
    LOGLIKELIHOOD,
    ROLLING,
    Document,
    GenerationDoc,
    LoglikelihoodDoc,
    MultipleChoiceDoc,
    RollingDoc,
)
from layerbus.evals.items import continuations, doc_id_of
from layerbus.evals.results_json import NO_FILTER, FilterMetrics, TaskResult
from layerbus.evals.suites import LoadedTask, MetricSpec
from layerbus.evals.task_yaml import FilterStep, apply_filters
from layerbus.storage.records import NewItem

# The samples columns in file order, with their Arrow types (see samples_schema).
SAMPLE_FIELDS = (
    ("task", "string"), ("doc_id", "string"), ("kind", "string"), ("filter", "string"), ("group", "string"),
    ("prompt_hash", "string"), ("error", "string"),
    ("lls", "list<double>"), ("is_greedy", "list<bool>"), ("tokens", "list<int64>"),
    ("generated", "string"), ("filtered", "string"), ("gold", "list<int64>"), ("targets", "list<string>"),
    ("acc", "double"), ("acc_norm", "double"), ("exact_match", "double"),
    ("ll", "double"), ("words", "int64"), ("bytes", "int64"),
)  # fmt: skip
SAMPLE_COLUMNS = tuple(name for name, _ in SAMPLE_FIELDS)
# The 0/1 metrics, each its own column.
SCORE_COLUMNS = ("acc", "acc_norm", "exact_match")
# The columns a corpus metric's per-document item is made of (one column: the item itself; two: a pair).
CORPUS_ITEMS = {
    "perplexity": ("ll",),
    "word_perplexity": ("ll", "words"),
    "byte_perplexity": ("ll", "bytes"),
    "bits_per_byte": ("ll", "bytes"),
}
# How many failed document ids an IncompleteTaskError names before "and N more".
NAMED_FAILURES = 5


@dataclass(frozen=True)
class ItemOutcome:
    """What the job store reports for one eval item: its output column and its error."""

    # The runtime's answer: the scoring JSON, or the generated text; None when the item produced none.
    output: str | None
    # Why the item failed; None when it completed.
    error: str | None = None


@dataclass(frozen=True)
class MetricValue:
    """One metric of a task under one filter, aggregated over its documents."""

    metric: str
    # The filter the generations went through ("none" for unfiltered outputs and every scoring task).
    filter: str
    value: float
    # Standard error, clustered by group; None where lm-eval reports "N/A" (fewer than 2 documents).
    stderr: float | None
    # Documents aggregated.
    n: int


class IncompleteTaskError(ValueError):
    """A task has documents without scores; its metrics would silently be over the others."""

    def __init__(self, task: str, failed: list[tuple[str, str]], n_docs: int):
        self.task = task
        # (doc id, error) of every failed document, in document order.
        self.failed = failed
        named = "; ".join(f"{doc_id!r}: {error}" for doc_id, error in failed[:NAMED_FAILURES])
        more = f"; and {len(failed) - NAMED_FAILURES} more" if len(failed) > NAMED_FAILURES else ""
        way_out = "rerun their items" if len(failed) == n_docs else \
            "rerun their items, or allow failed documents to score the others (n then counts them)"
        super().__init__(f"task {task!r}: {len(failed)} of {n_docs} document(s) have no scores ({named}{more}); "
                         f"{way_out}")


class _Failed(Exception):
    """A document's output cannot be scored; the message becomes its row's error."""


def outcomes_by_doc(task: str, result_rows: Iterable[Mapping]) -> dict[str, ItemOutcome]:
    """The task's outcomes by document id, from a job's result rows (custom_id, output, error); other tasks' rows
    are skipped, since one job may hold a whole suite."""
    found = {}
    for row in result_rows:
        if str(row["custom_id"]).startswith(f"{task}/"):
            found[doc_id_of(task, row["custom_id"])] = ItemOutcome(row.get("output"), row.get("error"))
    return found


def filters_of(task: LoadedTask) -> dict[str, tuple[FilterStep, ...]]:
    """The filters a task's metrics are reported under: its YAML's filter_list for generation, else "none" alone."""
    if task.kind == GENERATION and task.filters:
        return dict(task.filters)
    return {NO_FILTER: ()}


def samples_rows(task: LoadedTask, items: Sequence[NewItem], outcomes: Mapping[str, ItemOutcome]) -> list[dict]:
    """One row per document and filter (see the module docstring), from the items queued for the task
    (items.task_items) and their outcomes by document id."""
    by_doc = {doc_id_of(task.name, item.custom_id): item for item in items}
    missing = [doc.id for doc in task.docs if doc.id not in by_doc]
    if missing or len(by_doc) != len(task.docs):
        raise ValueError(f"task {task.name!r}: the items are not the task's ({len(items)} items for "
                         f"{len(task.docs)} documents; no item for {missing[:NAMED_FAILURES]}): pass the items "
                         "task_items built for this task")
    rows = []
    for doc in task.docs:
        item = by_doc[doc.id]
        rows += _doc_rows(task, doc, item, outcomes.get(doc.id))
    return rows


def _doc_rows(task: LoadedTask, doc: Document, item: NewItem, outcome: ItemOutcome | None) -> list[dict]:
    base = dict.fromkeys(SAMPLE_COLUMNS)
    base.update(task=task.name, doc_id=doc.id, kind=task.kind, group=doc.group,
                prompt_hash=item.params.get("prompt_hash"), lls=[], is_greedy=[], tokens=[])
    base.update(_targets(doc))
    if isinstance(doc, RollingDoc):  # the denominators are the text's, known whatever the model did
        base.update(words=metrics.count_words(doc.text), bytes=metrics.count_bytes(doc.text))
    requested = {m.name: m for m in task.metrics}
    try:
        output = _output(item, outcome)
        if task.kind == GENERATION:
            generated = _cut_at_stops(output, item.params.get("stop", []))
            filters = filters_of(task).items()
            return [{**base, "filter": name, "generated": generated,
                     **_generation_scores(doc, generated, steps, requested)} for name, steps in filters]
        lls, greedy, tokens = _scored(item, output)
        return [{**base, "filter": NO_FILTER, **_scoring_scores(doc, lls, greedy, tokens, requested)}]
    except _Failed as failure:
        nan = {m: math.nan for m in requested if m in SCORE_COLUMNS}
        if task.kind in (LOGLIKELIHOOD, ROLLING):
            nan["ll"] = math.nan
        return [{**base, "filter": name, "error": str(failure), **nan} for name in filters_of(task)]


def _targets(doc: Document) -> dict:
    if isinstance(doc, MultipleChoiceDoc):
        return {"gold": list(doc.gold)}
    if isinstance(doc, GenerationDoc):
        return {"targets": list(doc.targets)}
    if isinstance(doc, LoglikelihoodDoc):
        return {"targets": [doc.continuation]}
    return {}


def _output(item: NewItem, outcome: ItemOutcome | None) -> str:
    if outcome is None:
        raise _Failed(f"no result for item {item.custom_id!r}: the job has not finished it")
    if outcome.error is not None:
        raise _Failed(f"the item failed: {outcome.error}")
    if outcome.output is None:
        raise _Failed(f"item {item.custom_id!r} completed with no output")
    return outcome.output


def _scored(item: NewItem, output: str) -> tuple[list[float], list[bool], list[int]]:
    """The runtime's scoring JSON, checked against what the item asked (one entry per continuation)."""
    asked = continuations(item.params["score"])
    try:
        answer = json.loads(output)
        lls, greedy, tokens = answer["ll"], answer["is_greedy"], answer["tokens"]
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise _Failed(f"the output is not the scoring JSON {{ll, is_greedy, tokens}} ({type(e).__name__}: {e}): "
                      f"{output[:80]!r}") from None
    if not len(lls) == len(greedy) == len(tokens) == len(asked):
        raise _Failed(f"the output has {len(lls)} ll, {len(greedy)} is_greedy and {len(tokens)} tokens entries for "
                      f"{len(asked)} continuations asked")
    if [int(n) for n in tokens] != [len(k) for k in asked]:
        raise _Failed(f"the output scored {tokens} tokens where the continuations have {[len(k) for k in asked]}")
    if any(not isinstance(ll, (int, float)) or isinstance(ll, bool) or math.isnan(ll) for ll in lls):
        raise _Failed(f"the output's log-likelihoods {lls} are not all numbers")
    return [float(ll) for ll in lls], [bool(g) for g in greedy], [int(n) for n in tokens]


def _scoring_scores(doc: Document, lls: list[float], greedy: list[bool], tokens: list[int],
                    requested: Mapping[str, MetricSpec]) -> dict:
    if isinstance(doc, MultipleChoiceDoc):
        scores = metrics.multiple_choice_scores(lls, doc.choices, doc.gold)
        return {"lls": lls, "is_greedy": greedy, "tokens": tokens, **_requested(scores, requested)}
    if isinstance(doc, LoglikelihoodDoc):
        scores = metrics.loglikelihood_scores(lls[0], greedy[0])
        return {"lls": lls, "is_greedy": greedy, "tokens": tokens, "ll": lls[0],
                **_requested({"acc": float(scores["acc"])}, requested)}
    total = sum(lls)  # rolling: the document's ll is the sum over its windows
    return {"lls": [total], "is_greedy": [all(greedy)], "tokens": [sum(tokens)], "ll": total}


def _requested(scores: Mapping[str, float], requested: Mapping[str, MetricSpec]) -> dict:
    return {name: value for name, value in scores.items() if name in requested}


def _cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """lm_eval.models.utils.postprocess_generated_text: the text before the first of the stop strings."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


def _generation_scores(doc: GenerationDoc, generated: str, steps: tuple[FilterStep, ...],
                       requested: Mapping[str, MetricSpec]) -> dict:
    filtered = apply_filters(generated, steps)
    row: dict = {"filtered": filtered}
    if "exact_match" in requested:
        row["exact_match"] = metrics.exact_match(filtered, doc.targets, **requested["exact_match"].options)
    return row


def metric_items(rows: Sequence[Mapping], metric: str) -> list:
    """The per-document items metrics.aggregate takes for metric, from samples rows (one filter's)."""
    columns = CORPUS_ITEMS.get(metric, (metric,))
    items = []
    for row in rows:
        values = [row.get(column) for column in columns]
        if any(v is None for v in values):
            raise ValueError(f"task {row.get('task')!r} document {row.get('doc_id')!r} has no "
                             f"{', '.join(c for c, v in zip(columns, values) if v is None)} for {metric}: "
                             "the task does not report that metric")
        items.append(values[0] if len(values) == 1 else (values[0], int(values[1])))
    return items


def task_metrics(task: LoadedTask, rows: Sequence[Mapping], bootstrap_iters: int = metrics.BOOTSTRAP_ITERS,
                 allow_failed: bool = False) -> list[MetricValue]:
    """Every metric of the task under every filter, in the task's metric order, over the task's rows.

    Raises IncompleteTaskError when documents have no scores, unless allow_failed (then they are left out).
    """
    own = [row for row in rows if row["task"] == task.name]
    absent = sorted({doc.id for doc in task.docs} - {row["doc_id"] for row in own})
    if absent:
        raise ValueError(f"task {task.name!r}: the rows lack {len(absent)} document(s) ({absent[:NAMED_FAILURES]}); "
                         "pass every row samples_rows gave for the task")
    failed = list(dict.fromkeys((row["doc_id"], row["error"]) for row in own if row["error"] is not None))
    if failed and (not allow_failed or len(failed) == len(task.docs)):
        raise IncompleteTaskError(task.name, failed, len(task.docs))
    values = []
    for filter_name in filters_of(task):
        scored = [row for row in own if row["filter"] == filter_name and row["error"] is None]
        groups = [row["group"] for row in scored]
        for spec in task.metrics:
            items = metric_items(scored, spec.name)
            values.append(MetricValue(spec.name, filter_name, metrics.aggregate(spec.name, items),
                                      metrics.stderr(spec.name, items, groups, bootstrap_iters), len(items)))
    return values


def task_result(task: LoadedTask, values: Sequence[MetricValue]) -> TaskResult:
    """The task's entry of the results JSON: its first filter's metrics, then the others'."""
    by_filter: dict[str, list[MetricValue]] = {}
    for value in values:
        by_filter.setdefault(value.filter, []).append(value)
    if not by_filter:
        raise ValueError(f"task {task.name!r}: no metric values to report")
    (first, first_values), *others = by_filter.items()
    metadata = task.config.get("metadata")
    return TaskResult(
        task=task.name,
        metrics={v.metric: v.value for v in first_values},
        stderrs={v.metric: v.stderr for v in first_values},
        n_original=task.n_original,
        n_effective=first_values[0].n,
        config=task.config,
        num_fewshot=task.num_fewshot,
        version=metadata.get("version", 0) if isinstance(metadata, dict) else 0,
        filter_name=first,
        other_filters=tuple(FilterMetrics(name, {v.metric: v.value for v in vs}, {v.metric: v.stderr for v in vs})
                            for name, vs in others),
    )


def samples_schema():
    """The samples Parquet schema (a pyarrow.Schema): SAMPLE_FIELDS' columns, every one nullable."""
    import pyarrow as pa

    def arrow_type(alias: str):
        if alias.startswith("list<"):
            return pa.list_(pa.type_for_alias(alias[len("list<"):-1]))
        return pa.type_for_alias(alias)

    return pa.schema([(name, arrow_type(alias)) for name, alias in SAMPLE_FIELDS])


def write_samples(path: str | Path, rows: Sequence[Mapping]) -> None:
    """Write the rows as the samples Parquet file at path, atomically (a crash leaves the old file or none)."""
    import pyarrow as pa

    from layerbus.storage.results import write_atomically

    for index, row in enumerate(rows):
        unknown = sorted(set(row) - set(SAMPLE_COLUMNS))
        if unknown:
            raise ValueError(f"samples row {index} has unknown column(s) {unknown}; columns are {SAMPLE_COLUMNS}")
    write_atomically(pa.Table.from_pylist(list(rows), schema=samples_schema()), Path(path))


def read_samples(path: str | Path) -> list[dict]:
    """The rows of a samples file; refuses a file without every samples column (another file, or an older one)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = [name for name in SAMPLE_COLUMNS if name not in table.column_names]
    if missing:
        raise ValueError(f"{path} is not a samples file: it lacks column(s) {missing}")
    return table.select(list(SAMPLE_COLUMNS)).to_pylist()
