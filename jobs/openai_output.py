"""A finished job's items as OpenAI Batch output and error lines (the per-line BatchRequestOutput object).

Completed items go to the output file, each with `response.body` in the form its input line's endpoint
asked for (`chat.completion` for /v1/chat/completions, `text_completion` for /v1/completions; items not
given as OpenAI lines answer as chat completions). Failed and cancelled items go to the error file with
`response: null` and `error: {code, message}`, as OpenAI writes requests it could not run.

Every id is derived from the job and the item's position, so writing the files twice gives the same
bytes. Light on purpose: `layerbus results` imports it, and must import neither SQLAlchemy nor torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from layerbus.jobs.item_params import ENDPOINT_KEY
from layerbus.jobs.logprobs import completions_logprobs

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
# error.code of each kind of item the error file holds.
REFUSED_CODE = "invalid_request"  # refused at submit: never ran (its message is the validation's)
FAILED_CODE = "generation_failed"  # ran and failed (prompt too long for the model, a stage error, ...)
CANCELLED_CODE = "batch_cancelled"  # the job was cancelled before the item ran


@dataclass(frozen=True)
class OutputJob:
    """What every line of one job shares."""

    # jobs.id; the seed of every id in the files.
    job_id: str
    # The model name the bodies carry.
    model: str
    # Unix seconds the bodies carry as `created`: when the job finished (the same on every rewrite).
    created: int


@dataclass(frozen=True)
class FileCounts:
    """How many lines went to each file."""

    output: int
    errors: int


def output_line(job: OutputJob, row: dict[str, Any], params: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(is_output, line) for one finished item: `row` is its result row (JobStore.item_results), `params`
    its stored params (JobStore.job_items). is_output is False for a line of the error file."""
    digest = _digest(job.job_id, row["seq"])
    line: dict[str, Any] = {"id": f"batch_req_{digest}", "custom_id": row["custom_id"], "response": None,
                            "error": None}
    if row["status"] == "completed":
        endpoint = params.get(ENDPOINT_KEY) or CHAT_ENDPOINT
        line["response"] = {"status_code": 200, "request_id": f"req_{digest}", "body": _body(job, row, digest, endpoint)}
        return True, line
    if row["status"] == "cancelled":
        line["error"] = {"code": CANCELLED_CODE, "message": "the job was cancelled before this request ran"}
    else:
        refused = row.get("prompt") is None
        line["error"] = {"code": REFUSED_CODE if refused else FAILED_CODE,
                         "message": row.get("error") or "the request failed without a recorded reason"}
    return False, line


def write_openai_files(job: OutputJob, items: Iterable[tuple[dict[str, Any], dict[str, Any]]], output: TextIO,
                       errors: TextIO | None) -> FileCounts:
    """Write one line per item, in the order given, to `output` or `errors` (error lines are counted but
    not written when `errors` is None). One line is held at a time: any number of items fits in memory."""
    written = {True: 0, False: 0}
    for row, params in items:
        is_output, line = output_line(job, row, params)
        target = output if is_output else errors
        if target is not None:
            target.write(json.dumps(line, ensure_ascii=False) + "\n")
        written[is_output] += 1
    return FileCounts(output=written[True], errors=written[False])


def join_by_seq(results: Iterable[dict[str, Any]], items: Iterable[Any]) -> Iterator[tuple[dict[str, Any], dict]]:
    """Pair each result row with its queued item's params: both streams in seq order (JobStore.item_results
    and JobStore.job_items), read side by side. The row gains "prompt" (None for items refused at submit)."""
    queued = iter(items)
    for row in results:
        for item in queued:
            if item.seq == row["seq"]:
                yield {**row, "prompt": item.prompt or None}, item.params
                break
        else:
            raise ValueError(f"result row {row['custom_id']!r} (seq {row['seq']}) has no queued item: "
                             "the store changed while it was read; run the command again")


def _body(job: OutputJob, row: dict[str, Any], digest: str, endpoint: str) -> dict[str, Any]:
    text = row["output"] or ""
    prompt_tokens, completion_tokens = int(row["prompt_tokens"] or 0), int(row["completion_tokens"] or 0)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    logprobs = json.loads(row["logprobs"]) if row.get("logprobs") else None
    # The prompt's log-probabilities go where vLLM puts them, beside the choices; the choice's own are the output's.
    prompt_logprobs = logprobs.pop("prompt", None) if logprobs is not None else None
    extra = {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else {}
    if logprobs is not None and logprobs.get("content") is None:
        logprobs = None  # only the prompt's were asked for
    if endpoint == COMPLETIONS_ENDPOINT:
        logprobs = completions_logprobs(logprobs) if logprobs is not None else None
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": row["finish_reason"]}
        return {"id": f"cmpl-{digest}", "object": "text_completion", "created": job.created, "model": job.model,
                "choices": [choice], "usage": usage, **extra}
    message = {"role": "assistant", "content": text, "refusal": None}
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": row["finish_reason"]}
    return {"id": f"chatcmpl-{digest}", "object": "chat.completion", "created": job.created, "model": job.model,
            "choices": [choice], "usage": usage, "system_fingerprint": None, **extra}


def _digest(job_id: str, seq: int) -> str:
    return hashlib.sha256(f"{job_id}:{seq}".encode()).hexdigest()[:32]
