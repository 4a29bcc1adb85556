"""lm-evaluation-harness requests as layerbus job items, and the items' outputs back as lm-eval's answers.

Pure: token ids in, item params out (and output JSON in, numbers out); no lm_eval, torch or store import,
so the adapter's arithmetic is tested without either. The adapter (evals/lm_eval_adapter.py) does the
tokenizing with lm-eval's own TemplateLM code and hands the ids here.

Scoring follows lm-eval's HF backend (HFLM._loglikelihood_tokens) exactly: a request (context ids,
continuation ids) runs the model on (context + continuation)[-(max_length + 1):][:-1] and reads the
continuation's log-probabilities from the last len(continuation) positions. As a layerbus score segment
that is [the kept ids minus the continuation, [continuation]]: the same positions, the same targets.
Requests whose truncated contexts are equal become one item with several continuations, so the context is
prefilled once for all of them (a multiple-choice question's choices), which is where layerbus gains
over HFLM's one forward pass per request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from layerbus.jobs.item_params import PROMPT_IDS_KEY
from layerbus.jobs.score_items import SCORE_KEY

# What an item's input column shows of its text (the token ids are in its params); the results file stays small.
INPUT_PREVIEW_CHARS = 200


@dataclass(frozen=True)
class PlannedItem:
    """One job item to queue: its params (what the broker computes) and a readable input column."""

    params: dict[str, Any]
    input: str


@dataclass(frozen=True)
class ScorePlan:
    """Score items for lm-eval requests, and where each request's answer lands."""

    items: tuple[PlannedItem, ...]
    # Request i's answer is continuation answers[i][1] of item answers[i][0] (continuations counted over the
    # item's segments in order, as the output JSON lists them).
    answers: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RollingPlan:
    """One score item per document (a segment per rolling window); the document's ll is the item's sum."""

    items: tuple[PlannedItem, ...]
    # Document i's item, or None for a text that tokenizes to nothing (lm-eval scores it 0.0 without a model).
    documents: tuple[int | None, ...]


@dataclass(frozen=True)
class ScoreOutput:
    """A score item's output column: one entry per continuation, segments flattened in order."""

    ll: tuple[float, ...]
    is_greedy: tuple[bool, ...]


def truncated_segment(context_ids: Sequence[int], continuation_ids: Sequence[int],
                      max_length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(context ids, continuation ids) of the score segment that computes what HFLM computes for the pair.

    HFLM keeps the last max_length + 1 ids of context + continuation and drops the last one: the context
    of the segment is what is kept before the continuation (at least one id, as the continuation fits).
    """
    if not context_ids or not continuation_ids:
        raise ValueError(f"an lm-eval loglikelihood request needs context and continuation ids, got "
                         f"{len(context_ids)} context and {len(continuation_ids)} continuation id(s)")
    if len(continuation_ids) > max_length:
        raise ValueError(f"a continuation of {len(continuation_ids)} tokens does not fit max_length={max_length} "
                         f"(lm-eval's HF backend refuses it too); raise max_length up to the model's limit")
    kept = (list(context_ids) + list(continuation_ids))[-(max_length + 1):]
    return tuple(kept[:len(kept) - len(continuation_ids)]), tuple(continuation_ids)


def plan_loglikelihood(requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int,
                       texts: Sequence[str] | None = None) -> ScorePlan:
    """Items for lm-eval loglikelihood requests (context ids, continuation ids), grouped by truncated context.

    Items follow the order in which their context first appears, continuations the request order, so the
    same requests always give the same items (the job's name is their digest). `texts` (one per request)
    fill the input column.
    """
    groups: dict[tuple[int, ...], int] = {}
    contexts: list[tuple[int, ...]] = []
    continuations: list[list[list[int]]] = []
    previews: list[str] = []
    answers: list[tuple[int, int]] = []
    for index, (context_ids, continuation_ids) in enumerate(requests):
        context, continuation = truncated_segment(context_ids, continuation_ids, max_length)
        item = groups.get(context)
        if item is None:
            item = groups[context] = len(contexts)
            contexts.append(context)
            continuations.append([])
            previews.append(texts[index][:INPUT_PREVIEW_CHARS] if texts is not None else "")
        answers.append((item, len(continuations[item])))
        continuations[item].append(list(continuation))
    items = tuple(PlannedItem({SCORE_KEY: [[list(context), conts]]}, preview)
                  for context, conts, preview in zip(contexts, continuations, previews))
    return ScorePlan(items, tuple(answers))


def plan_rolling(documents: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], max_length: int,
                 texts: Sequence[str] | None = None) -> RollingPlan:
    """Items for lm-eval loglikelihood_rolling: each document's disjoint windows (context ids, predicted ids)
    as the segments of one item, truncated as HFLM truncates every window it scores."""
    items: list[PlannedItem] = []
    slots: list[int | None] = []
    for index, windows in enumerate(documents):
        if not windows:
            slots.append(None)
            continue
        segments = [[list(context), [list(predicted)]]
                    for context, predicted in (truncated_segment(c, p, max_length) for c, p in windows)]
        slots.append(len(items))
        items.append(PlannedItem({SCORE_KEY: segments}, texts[index][:INPUT_PREVIEW_CHARS] if texts else ""))
    return RollingPlan(tuple(items), tuple(slots))


def generation_params(prompt_ids: Sequence[int], max_gen_toks: int, stop: Sequence[str]) -> dict[str, Any]:
    """A greedy generation item's params: the prompt as lm-eval tokenized it, its budget and stop strings.

    Empty stop strings are left out: lm-eval ignores them when cutting, and an empty string would stop
    layerbus at once.
    """
    if not prompt_ids:
        raise ValueError("a generation request tokenized to no ids: the model has nothing to continue; give the "
                         "task a non-empty context (or a tokenizer that adds a BOS token)")
    return {PROMPT_IDS_KEY: list(prompt_ids), "max_tokens": int(max_gen_toks),
            "stop": [s for s in stop if s], "temperature": 0}


def job_name(model_identity: dict[str, Any], kind: str, numerics: dict[str, Any],
             items: Sequence[PlannedItem]) -> str:
    """lm-eval-<sha256> over what decides the outputs: the model directory's fingerprint, the request kind,
    the settings that change the numbers (wire codec, stage dtype and device), and every item's params.
    The same call over the same model finds the same job again (and resumes or re-reads it)."""
    digest = hashlib.sha256()
    header = {"model": model_identity, "kind": kind, "numerics": numerics}
    digest.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for item in items:  # one update per item: no single giant string for a large eval
        digest.update(b"\n")
        digest.update(json.dumps(item.params, sort_keys=True, separators=(",", ":")).encode())
    return f"lm-eval-{digest.hexdigest()}"


def read_score_output(custom_id: str, output: str | None) -> ScoreOutput:
    """A completed score item's output JSON; ValueError naming the item when it is missing or malformed."""
    try:
        data = json.loads(output) if output is not None else None
        ll, greedy = data["ll"], data["is_greedy"]
        if len(ll) != len(greedy):
            raise ValueError("ll and is_greedy differ in length")
        return ScoreOutput(tuple(float(x) for x in ll), tuple(bool(g) for g in greedy))
    except (TypeError, KeyError, ValueError) as error:
        raise ValueError(f"item {custom_id}: output {str(output)[:80]!r} is not a score output "
                         f"({{\"ll\": [...], \"is_greedy\": [...]}}): {error}") from None
