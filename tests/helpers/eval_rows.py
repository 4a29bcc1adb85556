"""An eval task loaded from documents written by hand, and the samples rows of hand-written answers to its items
(the tiny test tokenizer encodes them)."""

from __future__ import annotations

import json

from layerbus.evals.doc_results import ItemOutcome, samples_rows
from layerbus.evals.encoding import Encoder
from layerbus.evals.items import continuations, task_items
from layerbus.evals.suites import LoadedTask, MetricSpec
from tests.helpers.tiny_models import make_tiny_tokenizer

ENCODER = Encoder(make_tiny_tokenizer())


def loaded(kind, docs, metric_names, name="t", filters=None, options=None, config=None) -> LoadedTask:
    specs = tuple(MetricSpec(m, (options or {}).get(m, {})) for m in metric_names)
    return LoadedTask(name, kind, tuple(docs), len(docs) + 1, specs, 0, 1234, config or {"task": name},
                      filters or {})


def scoring_output(item, lls, greedy=None) -> ItemOutcome:
    """The runtime's answer to a scoring item: one entry per continuation asked, tokens as asked."""
    asked = continuations(item.params["score"])
    assert len(lls) == len(asked)
    greedy = greedy if greedy is not None else [False] * len(lls)
    return ItemOutcome(json.dumps({"ll": lls, "is_greedy": greedy, "tokens": [len(k) for k in asked]}))


def rows_for(task, answers, max_length=100):
    """(items, samples rows) for answers by doc id: lls, or (lls, is_greedy), for scoring; the text for generation;
    an ItemOutcome as given. A document without an answer has no outcome (its item has not finished)."""
    items = task_items(task, ENCODER, max_length)
    outcomes = {}
    for item in items:
        doc_id = item.custom_id.split("/", 1)[1]
        answer = answers.get(doc_id)
        if isinstance(answer, (ItemOutcome, str)):
            outcomes[doc_id] = answer if isinstance(answer, ItemOutcome) else ItemOutcome(answer)
        elif answer is not None:
            outcomes[doc_id] = scoring_output(item, *answer) if isinstance(answer, tuple) else \
                scoring_output(item, answer)
    return items, samples_rows(task, items, outcomes)
