"""Scoring items (evals): what their params ask of the broker, and the output JSON their results become.

An item whose params carry "score" is scored, not generated: params["score"] is a list of segments
[context_ids, [continuation_ids, ...]] (see broker/scoring.py for how they are fed). Its output is
{"ll": [...], "is_greedy": [...], "tokens": [...]}, one entry per continuation, segments flattened
in order: the summed log-probability, whether every token was the argmax, and the token count.
"""

from __future__ import annotations

import json
from typing import Any

from layerbus.broker.requests import GenerationResult, ScoreRequest, ScoreSegment

SCORE_KEY = "score"


def is_scoring(params: dict[str, Any]) -> bool:
    return SCORE_KEY in params


def score_request(request_id: str, params: dict[str, Any]) -> ScoreRequest:
    """The ScoreRequest an item's params describe; ValueError names what is malformed."""
    segments = params[SCORE_KEY]
    if not isinstance(segments, list) or not segments:
        raise ValueError(f"item {request_id}: params {SCORE_KEY!r} must be a non-empty list of "
                         f"[context_ids, [continuation_ids, ...]], got {str(segments)[:80]}")
    built = []
    for segment in segments:
        if not (isinstance(segment, list) and len(segment) == 2 and _ids(segment[0])
                and isinstance(segment[1], list) and all(_ids(c) for c in segment[1])):
            raise ValueError(f"item {request_id}: score segment must be [context_ids, [continuation_ids, ...]] of "
                             f"token ids, got {str(segment)[:80]}")
        try:
            built.append(ScoreSegment(tuple(segment[0]), tuple(tuple(c) for c in segment[1])))
        except ValueError as error:
            raise ValueError(f"item {request_id}: {error}") from None
    return ScoreRequest(request_id, tuple(built))


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def score_output(result: GenerationResult) -> str | None:
    """The output column of a scored item: None when it failed."""
    if result.scores is None:
        return None
    return json.dumps({"ll": [s.ll for s in result.scores], "is_greedy": [s.is_greedy for s in result.scores],
                       "tokens": [len(s.logprobs) for s in result.scores]})
