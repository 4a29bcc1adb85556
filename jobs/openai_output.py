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
# The error line of a cancelled item: (code, message). A batch whose completion window ran out says so instead
# (serve/batch_keeper.py).
CANCELLED_ERROR = (CANCELLED_CODE, "the job was cancelled before this request ran")


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


def output_line(job: OutputJob, row: dict[str, Any], params: dict[str, Any],
                samples: list[dict[str, Any]] | None = None,
                cancelled_error: tuple[str, str] = CANCELLED_ERROR) -> tuple[bool, dict[str, Any]]:
    """(is_output, line) for one finished item: `row` is its result row (JobStore.item_results), `params`
    its stored params (JobStore.job_items); `samples`, an item's rows when it has n > 1 samples (row is then
    the first), become its choices, in sample order. is_output is False for a line of the error file: an item
    any of whose samples failed goes there, with the first failed sample's error."""
    samples = samples or [row]
    digest = _digest(job.job_id, row["seq"])
    line: dict[str, Any] = {"id": f"batch_req_{digest}", "custom_id": row["custom_id"], "response": None,
                            "error": None}
    if all(sample["status"] == "completed" for sample in samples):
        endpoint = params.get(ENDPOINT_KEY) or CHAT_ENDPOINT
        body = _body(job, samples, digest, endpoint)
        line["response"] = {"status_code": 200, "request_id": f"req_{digest}", "body": body}
        return True, line
    row = next(sample for sample in samples if sample["status"] != "completed")
    if row["status"] == "cancelled":
        line["error"] = {"code": cancelled_error[0], "message": cancelled_error[1]}
    else:
        refused = row.get("prompt") is None
        line["error"] = {"code": REFUSED_CODE if refused else FAILED_CODE,
                         "message": row.get("error") or "the request failed without a recorded reason"}
    return False, line


def write_openai_files(job: OutputJob, items: Iterable[tuple[dict[str, Any], dict[str, Any]]], output: TextIO,
                       errors: TextIO | None, cancelled_error: tuple[str, str] | None = None) -> FileCounts:
    """Write one line per item, in the order given, to `output` or `errors` (error lines are counted but
    not written when `errors` is None). One line is held at a time: any number of items fits in memory."""
    written = {True: 0, False: 0}
    for samples, params in _by_item(items):
        is_output, line = output_line(job, samples[0], params, samples, cancelled_error or CANCELLED_ERROR)
        target = output if is_output else errors
        if target is not None:
            target.write(json.dumps(line, ensure_ascii=False) + "\n")
        written[is_output] += 1
    return FileCounts(output=written[True], errors=written[False])


def join_by_seq(results: Iterable[dict[str, Any]], items: Iterable[Any]) -> Iterator[tuple[dict[str, Any], dict]]:
    """Pair each result row with its queued item's params: both streams in seq order (JobStore.item_results
    and JobStore.job_items), read side by side; an item's samples are consecutive rows of one seq. The row
    gains "prompt" (None for items refused at submit)."""
    queued = iter(items)
    current = None
    for row in results:
        if current is None or current.seq != row["seq"]:
            for item in queued:
                if item.seq == row["seq"]:
                    current = item
                    break
            else:
                raise ValueError(f"result row {row['custom_id']!r} (seq {row['seq']}) has no queued item: "
                                 "the store changed while it was read; run the command again")
        yield {**row, "prompt": current.prompt or None}, current.params


def _by_item(items: Iterable[tuple[dict[str, Any], dict[str, Any]]]) -> Iterator[tuple[list[dict[str, Any]], dict]]:
    """Consecutive rows of one item (its samples, by seq) as one list, with the item's params."""
    rows: list[dict[str, Any]] = []
    params: dict[str, Any] = {}
    for row, row_params in items:
        if rows and row["seq"] != rows[0]["seq"]:
            yield rows, params
            rows = []
        rows.append(row)
        params = row_params
    if rows:
        yield rows, params


def _body(job: OutputJob, samples: list[dict[str, Any]], digest: str, endpoint: str) -> dict[str, Any]:
    """The response body: one choice per sample (index 0 to n-1); usage counts the prompt once and the
    completion tokens of every sample, as OpenAI's does for n > 1."""
    prompt_tokens = int(samples[0]["prompt_tokens"] or 0)
    completion_tokens = sum(int(sample["completion_tokens"] or 0) for sample in samples)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    # The prompt's log-probabilities (the same for every sample) go where vLLM puts them, beside the choices.
    prompt_logprobs = _prompt_logprobs(samples[0])
    extra = {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else {}
    if endpoint == COMPLETIONS_ENDPOINT:
        return {"id": f"cmpl-{digest}", "object": "text_completion", "created": job.created, "model": job.model,
                "choices": [_completions_choice(index, row) for index, row in enumerate(samples)], "usage": usage,
                **extra}
    return {"id": f"chatcmpl-{digest}", "object": "chat.completion", "created": job.created, "model": job.model,
            "choices": [_chat_choice(index, row) for index, row in enumerate(samples)], "usage": usage,
            "system_fingerprint": None, **extra}


def _output_logprobs(row: dict[str, Any]) -> dict[str, Any] | None:
    """The stored choice.logprobs of a row without the prompt's; None when only the prompt's were asked for."""
    logprobs = json.loads(row["logprobs"]) if row.get("logprobs") else None
    if logprobs is None:
        return None
    logprobs.pop("prompt", None)
    return logprobs if logprobs.get("content") is not None else None


def _prompt_logprobs(row: dict[str, Any]) -> list[Any] | None:
    return json.loads(row["logprobs"]).get("prompt") if row.get("logprobs") else None


def _completions_choice(index: int, row: dict[str, Any]) -> dict[str, Any]:
    logprobs = _output_logprobs(row)
    logprobs = completions_logprobs(logprobs) if logprobs is not None else None
    return {"index": index, "text": row["output"] or "", "logprobs": logprobs, "finish_reason": row["finish_reason"]}


def _chat_choice(index: int, row: dict[str, Any]) -> dict[str, Any]:
    message = {"role": "assistant", "content": row["output"] or "", "refusal": None}
    return {"index": index, "message": message, "logprobs": _output_logprobs(row), "finish_reason": row["finish_reason"]}


def _digest(job_id: str, seq: int) -> str:
    return hashlib.sha256(f"{job_id}:{seq}".encode()).hexdigest()[:32]
