"""One JSON Lines item: an OpenAI batch line or the simple {"id", "text"} form, checked into an ItemOutcome.

A line with "method", "url" or an object "body" is an OpenAI batch line; any other object is the simple form,
read by its standard keys or by the keys the column options name (jobs/columns.py).
"""

from __future__ import annotations

import json
from dataclasses import replace

from layerbus.jobs.columns import ColumnMap, choose_columns, nested_names, value_at
from layerbus.jobs.constraints import BODY_CONSTRAINT_KEYS, CONSTRAINT_KEY, check_body_constraint
from layerbus.jobs.records import InputRecord
from layerbus.wire.sampling import MAX_TOP_LOGPROBS

from layerbus.jobs.item_checks import (
    PARAM_NAMES,
    ItemOutcome,
    check_id,
    check_messages,
    check_params,
    check_text,
    make_record,
    show,
    type_name,
    unknown_names,
)

# Top-level keys of the simple form: an id, the content, and per-item parameters.
# Asking for log-probabilities: OpenAI's chat form (logprobs: bool, top_logprobs: 0..20); on /v1/completions
# logprobs is the legacy count of top tokens (0..5). prompt_logprobs (vLLM's name) asks for the prompt's own
# tokens' log-probabilities (scoring a text): true, or 0 as vLLM counts it (no alternatives besides the token).
LOGPROB_KEYS = ("logprobs", "top_logprobs", "prompt_logprobs")
SIMPLE_KEYS = ("id", "custom_id", "text", "prompt", "messages", *PARAM_NAMES, *BODY_CONSTRAINT_KEYS, *LOGPROB_KEYS)
# Top-level keys of an OpenAI batch line; all four are required, as in OpenAI's own files.
OPENAI_KEYS = ("custom_id", "method", "url", "body")
# Body keys we honour. "model" must name the job's model (checked at submit: a job runs one model).
# Anything else (tools, functions, ...) is refused rather than silently not done.
BODY_KEYS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", *PARAM_NAMES[1:],
             *BODY_CONSTRAINT_KEYS, *LOGPROB_KEYS)
# Each supported endpoint, and the body key holding its content.
OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    # json.loads keeps the last of two equal keys silently; a repeated "text" is almost always an editing slip.
    # dict() in C first: a million-line submit parses a million objects, and nearly none repeat a key.
    seen = dict(pairs)
    if len(seen) != len(pairs):
        keys: set[str] = set()
        for key, _ in pairs:
            if key in keys:
                raise _DuplicateKey(f"key {key!r} appears twice in one object")
            keys.add(key)
    return seen


# One decoder for every line: json.loads with a hook builds a new JSONDecoder per call.
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)


class JsonlColumns:
    """The keys simple-form lines are read by: the standard ones (id, text, ...), or the ones the column
    options name or that are inferred from the first simple-form line's keys, nested ones dotted."""

    def __init__(self, task: str, given: ColumnMap | None = None) -> None:
        self._task = task
        self._given = given or ColumnMap()
        self._decided = False
        # The keys to read by; None: the standard keys.
        self.columns: ColumnMap | None = None
        # Why no line of the file can be read (a mapping that does not fit the first line), or None.
        self.problem: str | None = None

    def item(self, item: dict, line: int) -> dict:
        """The item in the simple form's standard keys."""
        if not self._decided:
            self._decide(item, line)
        if self.columns is None:
            return item
        kept = {key: value for key, value in item.items() if key in SIMPLE_KEYS and key not in _CONTENT_KEYS}
        mapped = {role: value_at(item, column) for role, column in self.columns.named().items()}
        return {**kept, **{role: value for role, value in mapped.items() if value is not None}}

    def _decide(self, item: dict, line: int) -> None:
        self._decided = True
        if not self._given.named() and set(_CONTENT_KEYS) & set(item):
            return  # a line of the simple form; a slip in it is that line's problem, as ever
        found_in = f"keys found in line {line}"
        self.columns, self.problem = choose_columns(nested_names(item), self._task, self._given, found_in)


_CONTENT_KEYS = ("id", "custom_id", "text", "prompt", "messages")


def parse_jsonl_line(raw: str, task: str, source: str, line: int, keys: JsonlColumns | None = None) -> ItemOutcome:
    """Check one non-blank line of a JSONL input; keys: how simple-form lines are read (the standard keys
    when None)."""
    outcome = ItemOutcome(source, line, raw, f"line {line}", f"line-{line}")
    try:
        # json.loads words a byte-order mark inside the file its own way; JSONDecoder.decode does not.
        item = _DECODER.decode(raw) if not raw.startswith("\ufeff") else json.loads(
            raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        return outcome.refuse([str(e)])
    except json.JSONDecodeError as e:
        return outcome.refuse([f"malformed JSON: {e.msg} at column {e.colno}"])
    if not isinstance(item, dict):
        return outcome.refuse([f"expected a JSON object, got {type_name(item)}"])
    # A "body" that is text is a dataset's document column, not an OpenAI request's body.
    is_openai = "method" in item or "url" in item or isinstance(item.get("body"), dict)
    if not is_openai and keys is not None:
        item = keys.item(item, line)
    custom_id, record, reasons = (_openai_item if is_openai else _simple_item)(item, task, source, line)
    outcome.custom_id, outcome.record = custom_id, record
    return outcome.refuse(reasons)


def body_model(raw: bytes) -> str | None:
    """The model an OpenAI batch line names (body.model, stripped), or None when it names none or does not parse."""
    try:
        item = json.loads(raw)
    except ValueError:
        return None
    body = item.get("body") if isinstance(item, dict) else None
    model = body.get("model") if isinstance(body, dict) else None
    return model.strip() if isinstance(model, str) and model.strip() else None


def _unknown_keys(item: dict, accepted: tuple[str, ...], where: str) -> list[str]:
    unknown = [key for key in item if key not in accepted]
    return [unknown_names(f"{where}key(s)", unknown, accepted)] if unknown else []


Checked = tuple[str | None, InputRecord | None, list[str]]  # (the id if usable, the record if valid, reasons)


def _simple_item(item: dict, task: str, source: str, line: int) -> Checked:
    reasons = _unknown_keys(item, SIMPLE_KEYS, "")
    if "id" in item and "custom_id" in item:
        reasons.append("give id or custom_id, not both")
    id_key = "custom_id" if "custom_id" in item else "id"
    custom_id, id_reasons = check_id(item.get(id_key), id_key)
    params, param_reasons = check_params({name: (name, item[name]) for name in PARAM_NAMES if name in item})
    params, param_reasons = _with_constraint(item, "", params, param_reasons)
    params, param_reasons = _with_logprobs(item, "", "/v1/chat/completions", params, param_reasons)
    content = {key: item.get(key) for key in ("text", "prompt", "messages")}
    record, content_reasons = make_record(task, custom_id, content, params, source, line)
    reasons += id_reasons + content_reasons + param_reasons
    return custom_id, record, reasons


def _openai_item(item: dict, task: str, source: str, line: int) -> Checked:
    reasons = _unknown_keys(item, OPENAI_KEYS, "")
    reasons += [f"missing {key}: an OpenAI batch line needs {', '.join(OPENAI_KEYS)}" for key in OPENAI_KEYS
                if key not in item]
    custom_id, id_reasons = check_id(item.get("custom_id"), "custom_id")
    reasons += id_reasons if "custom_id" in item else []
    if "method" in item and item["method"] != "POST":
        reasons.append(f'method must be "POST", got {show(item["method"])}')
    url = item.get("url")
    known_url = isinstance(url, str) and url in OPENAI_URLS  # isinstance first: a list url is unhashable
    if "url" in item and not known_url:
        reasons.append(f"url {show(url)} is not supported; accepted: {', '.join(OPENAI_URLS)}")
    body = item.get("body")
    if "body" in item and not isinstance(body, dict):
        reasons.append(f"body must be an object, got {type_name(body)}")
    if not known_url or not isinstance(body, dict):
        return custom_id, None, reasons
    content, content_reasons = _openai_content(body, url, task)
    params, param_reasons = _with_logprobs(body, "body.", url, *_openai_params(body))
    reasons += content_reasons + param_reasons
    if content_reasons:
        return custom_id, None, reasons
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and model.strip()):
        reasons.append(f"body.model must be the model's name as a non-empty string, got {show(model)}")
    record, record_reasons = make_record(task, custom_id, content, params, source, line)
    if record is not None and isinstance(model, str) and model.strip():
        record = replace(record, model=model.strip())
    if record is not None:
        record = replace(record, endpoint=url)
    return custom_id, record, reasons + record_reasons


def _openai_content(body: dict, url: str, task: str) -> tuple[dict[str, object], list[str]]:
    """The item's content. For summarize and translate the document is the completion prompt, or the last
    message of a chat line (which must be the user's); other chat messages are not used, since the task
    supplies its own instruction."""
    reasons = _unknown_keys(body, BODY_KEYS, "body ")
    key = OPENAI_URLS[url]
    other = "prompt" if key == "messages" else "messages"
    if other in body:
        reasons.append(f"body.{other} does not belong on {url}: use body.{key}, or url "
                       f"{next(u for u, k in OPENAI_URLS.items() if k == other)}")
    if key not in body:
        reasons.append(f"missing body.{key}: {url} needs it")
        return {}, reasons
    value = body[key]
    if task == "generate":
        return {key: value}, reasons
    if key == "prompt":
        return {"text": value}, reasons + check_text(value, "body.prompt")
    messages, message_reasons = check_messages(value, "body.messages")
    if message_reasons:
        return {}, reasons + message_reasons
    if messages[-1]["role"] != "user":
        reasons.append(f"for --task {task} the document must be the last message, from the user; "
                       f"the last message is from {messages[-1]['role']!r}")
    document = messages[-1]["content"]
    return {"text": document}, reasons + check_text(document, f"body.messages[{len(messages) - 1}].content")


def _openai_params(body: dict) -> tuple[dict, list[str]]:
    given = {name: (f"body.{name}", body[name]) for name in PARAM_NAMES if name in body}
    if "max_completion_tokens" in body:
        if "max_tokens" in body:
            return {}, ["give body.max_tokens or body.max_completion_tokens, not both"]
        given["max_tokens"] = ("body.max_completion_tokens", body["max_completion_tokens"])
    return _with_constraint(body, "body.", *check_params(given))


def _with_prompt_logprobs(fields: dict, where: str, params: dict, reasons: list[str]) -> tuple[dict, list[str]]:
    if "prompt_logprobs" not in fields or fields["prompt_logprobs"] is False:
        return params, reasons
    value = fields["prompt_logprobs"]
    if value is True or (type(value) is int and value == 0):
        return {**params, "prompt_logprobs": True}, reasons
    if type(value) is int and value > 0:
        return params, reasons + [f"{where}prompt_logprobs {value}: the prompt's alternatives are not computed, only "
                                  f"its own tokens' log-probabilities; give {where}prompt_logprobs: 0 (or true)"]
    return params, reasons + [f"{where}prompt_logprobs must be true, false or 0, got {show(value)}"]


def _with_logprobs(fields: dict, where: str, url: str, params: dict, reasons: list[str]) -> tuple[dict, list[str]]:
    """params plus what the fields ask of log-probabilities, stored as {"logprobs": true, "top_logprobs": k} and
    {"prompt_logprobs": true}."""
    params, reasons = _with_prompt_logprobs(fields, where, params, reasons)
    if "logprobs" not in fields and "top_logprobs" not in fields:
        return params, reasons
    logprobs, top = fields.get("logprobs"), fields.get("top_logprobs")
    if url == "/v1/completions":
        if "top_logprobs" in fields:
            return params, reasons + [f"{where}top_logprobs is for /v1/chat/completions; on {url} give "
                                      f"{where}logprobs as the number of top tokens (0 to 5)"]
        if logprobs is None:
            return params, reasons
        if type(logprobs) is not int or not 0 <= logprobs <= 5:
            return params, reasons + [f"{where}logprobs on {url} must be an integer from 0 to 5, got {show(logprobs)}"]
        return {**params, "logprobs": True, "top_logprobs": logprobs}, reasons
    if logprobs is not None and type(logprobs) is not bool:
        return params, reasons + [f"{where}logprobs must be true or false, got {show(logprobs)}"]
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
        return params, reasons + [f"{where}top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {show(top)}"]
    if top and not logprobs:
        return params, reasons + [f"{where}top_logprobs needs {where}logprobs: true"]
    if not logprobs:
        return params, reasons
    return {**params, "logprobs": True, "top_logprobs": top or 0}, reasons


def _with_constraint(fields: dict, where: str, params: dict, reasons: list[str]) -> tuple[dict, list[str]]:
    """params plus the output constraint the fields give (response_format, guided_regex, guided_choice)."""
    constraint, constraint_reasons = check_body_constraint(fields, where)
    if constraint is not None:
        params = {**params, CONSTRAINT_KEY: constraint}
    return params, reasons + constraint_reasons
