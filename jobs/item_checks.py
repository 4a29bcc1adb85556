"""Checks shared by every input format: an item's id, its content for the task, and its sampling parameters.

Each check returns the cleaned value and a list of reasons; an empty list means the value is valid. The
format readers (JSONL, CSV, Parquet, .txt directory) only find the fields; the rules live here, once.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from layerbus.jobs.records import InputProblem, InputRecord

# Per-item sampling parameters an item may override, in the order error messages list them.
PARAM_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n")
# Samples per item (OpenAI's n): each is its own sequence, so the cap bounds what one item can take of a job.
MAX_SAMPLES = 128
# Chat roles the chat templates we target all understand.
MESSAGE_ROLES = ("system", "user", "assistant")
# Seeds are stored in int64 columns (job store, Parquet), so they must fit one.
_SEED_LIMIT = 2**63


@dataclass
class ItemOutcome:
    """One item as a format reader saw it: a record when valid, else the reasons it was refused."""

    # File the item's problems point at: the input file, or for a directory input the item's .txt file.
    source: str
    # Same meaning as InputRecord.line.
    line: int
    # The input as the user wrote it, kept for the failed-item record.
    raw: str
    # How messages name the item's place to a user: "line 7", "row 7", "file a.txt".
    where: str
    # Id used for the failed-item record when the item has no usable id of its own: "line-7".
    fallback_id: str
    # True when the item is a whole file (a directory input): its problems then carry line 0.
    whole_file: bool = False
    # The item's id when it has a usable one, valid item or not (duplicates are found by it).
    custom_id: str | None = None
    # The valid item, or None when problems were found.
    record: InputRecord | None = None
    # Every problem with this item.
    problems: list[InputProblem] = field(default_factory=list)

    def refuse(self, reasons: list[str]) -> ItemOutcome:
        """Record reasons against this item (if any) and drop its record; returns self."""
        line = 0 if self.whole_file else self.line
        self.problems += [InputProblem(self.source, line, reason) for reason in reasons]
        if self.problems:
            self.record = None
        return self


def show(value: object, limit: int = 60) -> str:
    """A short, single-line rendering of a user's value for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unknown_names(kind: str, unknown: list[str], accepted: tuple[str, ...]) -> str:
    """A message naming unknown keys or columns, with the likely intended name for a typo."""
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1)
        named.append(f"{show(name)} (did you mean {close[0]!r}?)" if close else show(name))
    return f"unknown {kind} {', '.join(named)}; accepted: {', '.join(accepted)}"


def type_name(value: object) -> str:
    """The JSON-ish name of a value's type, as users of JSON and CSV think of it."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def check_id(value: object, key: str) -> tuple[str | None, list[str]]:
    """An id is a non-blank string, or an integer (turned into its decimal string)."""
    if value is None:
        return None, [f"missing {key}: every item needs one so its result can be found in the output"]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), []
    if not isinstance(value, str):
        return None, [f"{key} must be a string or an integer, got {type_name(value)} {show(value)}"]
    if not value.strip():
        return None, [f"{key} is blank: give each item a non-empty id"]
    if "\x00" in value:
        return None, [f"{key} contains a NUL character (\\u0000); remove it"]
    return value, []


def check_messages(value: object, key: str) -> tuple[list[dict] | None, list[str]]:
    """Chat messages: a non-empty list of {"role", "content"} objects with string content."""
    if not isinstance(value, list):
        return None, [f"{key} must be an array of {{role, content}} objects, got {type_name(value)}"]
    if not value:
        return None, [f"{key} is empty: give at least one message"]
    reasons = []
    for i, message in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(message, dict):
            reasons.append(f"{where} must be an object, got {type_name(message)}")
            continue
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            reasons.append(f"{where} has unknown key(s) {', '.join(extra)}; accepted: role, content")
        if message.get("role") not in MESSAGE_ROLES:
            reasons.append(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {show(message.get('role'))}")
        if isinstance(message.get("content"), str) and "\x00" in message["content"]:
            reasons.append(f"{where}.content contains a NUL character (\\u0000); remove it")
        if not isinstance(message.get("content"), str):
            reasons.append(
                f"{where}.content must be a string (content-part arrays are not supported), "
                f"got {type_name(message.get('content'))}"
            )
    if reasons:
        return None, reasons
    return [{"role": m["role"], "content": m["content"]} for m in value], []


def check_text(value: object, key: str) -> list[str]:
    """A document or prompt: a string with something in it besides whitespace."""
    if not isinstance(value, str):
        return [f"{key} must be a string, got {type_name(value)} {show(value)}"]
    if not value.strip():
        return [f"{key} is empty"]
    if "\x00" in value:  # PostgreSQL cannot store it, and no tokenizer means anything by it
        return [f"{key} contains a NUL character (\\u0000); remove it"]
    return []


def _as_int(value: object) -> int | None:
    """An integer, or an integral float such as 128.0 (pandas writes int columns with gaps as floats)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _as_float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def check_param(name: str, value: object, key: str) -> tuple[object, str | None]:
    """One sampling parameter, checked against the range the sampler accepts; key is what the user wrote."""
    got = f"got {show(value)}"
    if name in ("max_tokens", "top_k"):
        number = _as_int(value)
        if number is None or number < 1:
            hint = "" if name == "max_tokens" else " (leave it out to keep every token)"
            return None, f"{key} must be a positive integer{hint}, {got}"
        return number, None
    if name == "n":
        number = _as_int(value)
        if number is None or not 1 <= number <= MAX_SAMPLES:
            return None, f"{key} must be an integer from 1 to {MAX_SAMPLES} (samples per item), {got}"
        return number, None
    if name == "seed":
        number = _as_int(value)
        if number is None or not 0 <= number < _SEED_LIMIT:
            return None, f"{key} must be an integer in [0, 2**63), {got}"
        return number, None
    if name == "temperature":
        number = _as_float(value)
        if number is None or number < 0:
            return None, f"{key} must be a number >= 0 (0 means greedy), {got}"
        return number, None
    if name == "top_p":
        number = _as_float(value)
        if number is None or not 0 < number <= 1:
            return None, f"{key} must be a number in (0, 1], {got}"
        return number, None
    if name == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            return None, f"{key} must be a non-empty string or an array of non-empty strings, {got}"
        return list(stops), None
    raise ValueError(f"unknown parameter {name!r}; known: {', '.join(PARAM_NAMES)}")


def check_params(given: dict[str, tuple[str, object]]) -> tuple[dict, list[str]]:
    """Check every given parameter; given maps a parameter name to (the key the user wrote, value)."""
    params, reasons = {}, []
    for name, (key, value) in given.items():
        clean, reason = check_param(name, value, key)
        if reason:
            reasons.append(reason)
        else:
            params[name] = clean
    return params, reasons


def make_record(
    task: str,
    custom_id: str | None,
    content: dict[str, object],
    params: dict,
    source: str,
    line: int,
) -> tuple[InputRecord | None, list[str]]:
    """Choose and check the item's content for the task; content maps "text"/"prompt"/"messages" to values.

    summarize and translate need a document in text. generate takes exactly one of prompt, messages, or
    text (a text is used as a raw prompt, so a corpus of documents can also be run as plain prompts).
    """
    given = {k: v for k, v in content.items() if v is not None}
    if task in ("summarize", "translate"):
        reasons = [
            f"{key} is a model prompt for --task generate; for --task {task} give the document as text"
            for key in ("prompt", "messages")
            if key in given
        ]
        reasons += check_text(given["text"], "text") if "text" in given else ["missing text: give the document"]
        fields = {"text": given.get("text"), "prompt": None, "messages": None}
    else:
        if len(given) > 1:
            return None, [f"give one of text, prompt or messages, not {' and '.join(sorted(given))}"]
        if not given:
            return None, ["missing prompt: give a prompt (raw text), messages (chat), or text"]
        key, value = next(iter(given.items()))
        messages, reasons = check_messages(value, key) if key == "messages" else (None, check_text(value, key))
        prompt = None if key == "messages" else value
        fields = {"text": None, "prompt": prompt, "messages": messages}
    if reasons or custom_id is None:
        return None, reasons
    record = InputRecord(custom_id=custom_id, params=params, source=source, line=line, **fields)
    return record, []
