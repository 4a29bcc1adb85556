"""One row of a task file checked into a typed document: which kind its fields make it, and every reason it is invalid.

Pure: a row is a dict of the values actually given (a Parquet null counts as not given). The file readers in
task_files.py only find rows; the rules live here.
"""

from __future__ import annotations

import difflib

from layerbus.evals.documents import (
    GENERATION,
    KIND_NAMES,
    LOGLIKELIHOOD,
    MULTIPLE_CHOICE,
    ROLLING,
    DOC_TYPES,
    Document,
)

# Keys any row may have.
COMMON_KEYS = ("id", "group")
# Keys of each kind, and the keys whose presence says "this row is of that kind".
KIND_KEYS = {
    MULTIPLE_CHOICE: ("context", "choices", "gold"),
    LOGLIKELIHOOD: ("context", "continuation"),
    ROLLING: ("text",),
    GENERATION: ("prompt", "messages", "targets", "until", "max_gen_toks"),
}
_MARKERS = {
    MULTIPLE_CHOICE: ("choices", "gold"),
    LOGLIKELIHOOD: ("continuation",),
    ROLLING: ("text",),
    GENERATION: ("prompt", "messages", "targets", "until", "max_gen_toks"),
}
ALL_KEYS = COMMON_KEYS + tuple(dict.fromkeys(k for keys in KIND_KEYS.values() for k in keys))
MESSAGE_ROLES = ("system", "user", "assistant")
KINDS_HELP = ("multiple choice (context, choices, gold), log-likelihood (context, continuation), "
              "rolling (text), or generation (prompt or messages, targets)")


def show(value: object, limit: int = 60) -> str:
    """A short, single-line rendering of a user's value for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_name(value: object) -> str:
    """The JSON name of a value's type, as the author of a JSONL file thinks of it."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def row_kind(row: dict) -> tuple[str | None, list[str]]:
    """The kind a row's fields make it, or the reason no single kind fits."""
    found = [kind for kind, markers in _MARKERS.items() if any(k in row for k in markers)]
    if len(found) == 1:
        return found[0], []
    if not found:
        hint = " (context alone is not enough: add continuation, or choices and gold)" if "context" in row else ""
        return None, [f"cannot tell the row's kind from its fields {show(sorted(row))}{hint}; give {KINDS_HELP}"]
    named = " and ".join(f"{KIND_NAMES[k]} ({', '.join(m for m in _MARKERS[k] if m in row)})" for k in found)
    return None, [f"the row mixes fields of {named}; one row is one kind"]


def check_row(row: dict, kind: str) -> tuple[Document | None, list[str]]:
    """The row as a document of kind, or every reason it is not one."""
    reasons = _unknown_keys(row, COMMON_KEYS + KIND_KEYS[kind])
    doc_id, id_reasons = check_id(row.get("id"))
    group, group_reasons = _check_group(row.get("group"))
    fields, field_reasons = _CHECKS[kind](row)
    reasons += id_reasons + group_reasons + field_reasons
    if reasons:
        return None, reasons
    return DOC_TYPES[kind](id=doc_id, group=group, **fields), []


def _unknown_keys(row: dict, accepted: tuple[str, ...]) -> list[str]:
    unknown = [key for key in row if key not in accepted]
    if not unknown:
        return []
    named = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), accepted, n=1)
        named.append(f"{show(name)} (did you mean {close[0]!r}?)" if close else show(name))
    return [f"unknown key(s) {', '.join(named)}; accepted for this kind: {', '.join(accepted)}"]


def check_id(value: object) -> tuple[str | None, list[str]]:
    """An id is a non-blank string, or an integer (turned into its decimal string)."""
    if value is None:
        return None, ["missing id: every document needs one so its samples row and comparisons can find it"]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), []
    if not isinstance(value, str) or not value.strip():
        return None, [f"id must be a non-blank string or an integer, got {type_name(value)} {show(value)}"]
    return value, []


def _check_group(value: object) -> tuple[str | None, list[str]]:
    if value is None:
        return None, []
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value), []
    if isinstance(value, str) and value.strip():
        return value, []
    return None, [f"group must be a non-blank string or an integer, got {type_name(value)} {show(value)}"]


def _check_string(row: dict, key: str, allow_empty: bool) -> list[str]:
    value = row.get(key)
    if value is None:
        return [f"missing {key}"]
    if not isinstance(value, str):
        return [f"{key} must be a string, got {type_name(value)} {show(value)}"]
    if not allow_empty and not value:
        return [f"{key} is empty"]
    return [f"{key} contains a NUL character (\\u0000); remove it"] if "\x00" in value else []


def _check_strings(value: object, key: str, least: int) -> tuple[tuple[str, ...] | None, list[str]]:
    """A list of non-empty strings with at least `least` entries."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None, [f"{key} must be an array of strings, got {show(value)}"]
    if len(value) < least:
        return None, [f"{key} has {len(value)} entries, needs at least {least}"]
    if any(not v for v in value):
        return None, [f"{key}[{[i for i, v in enumerate(value) if not v][0]}] is empty"]
    return tuple(value), []


def _multiple_choice(row: dict) -> tuple[dict, list[str]]:
    reasons = _check_string(row, "context", allow_empty=True)
    choices, choice_reasons = (None, ["missing choices"]) if "choices" not in row else \
        _check_strings(row["choices"], "choices", least=2)
    reasons += choice_reasons
    gold, gold_reasons = _check_gold(row.get("gold"), len(choices) if choices else None)
    reasons += gold_reasons
    if choices and len(set(choices)) < len(choices):
        reasons.append(f"choices repeat an entry {show(choices)}: equal choices get equal scores, so acc is ambiguous")
    return {"context": row.get("context"), "choices": choices, "gold": gold}, reasons


def _check_gold(value: object, n_choices: int | None) -> tuple[tuple[int, ...] | None, list[str]]:
    if value is None:
        return None, ["missing gold: the index of the correct choice (or a list of indices)"]
    golds = value if isinstance(value, list) else [value]
    if not golds or not all(isinstance(g, int) and not isinstance(g, bool) for g in golds):
        return None, [f"gold must be a choice index (integer from 0) or a non-empty list of them, got {show(value)}"]
    if n_choices is not None and any(not 0 <= g < n_choices for g in golds):
        return None, [f"gold {show(value)} is out of range for {n_choices} choices (indices are 0 to {n_choices - 1})"]
    if len(set(golds)) < len(golds):
        return None, [f"gold {show(value)} repeats an index"]
    return tuple(golds), []


def _loglikelihood(row: dict) -> tuple[dict, list[str]]:
    reasons = _check_string(row, "context", allow_empty=True) + _check_string(row, "continuation", allow_empty=False)
    return {"context": row.get("context"), "continuation": row.get("continuation")}, reasons


def _rolling(row: dict) -> tuple[dict, list[str]]:
    reasons = _check_string(row, "text", allow_empty=False)
    return {"text": row.get("text")}, reasons


def _generation(row: dict) -> tuple[dict, list[str]]:
    reasons = []
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        reasons.append("give one of prompt (raw text) or messages (chat), not " +
                       ("both" if prompt is not None else "neither"))
    elif prompt is not None:
        reasons += _check_string(row, "prompt", allow_empty=False)
    else:
        messages, message_reasons = _check_messages(messages)
        reasons += message_reasons
    targets, target_reasons = (None, ["missing targets: the list of accepted answers"]) if "targets" not in row \
        else _check_strings(row["targets"], "targets", least=1)
    until_value = row.get("until", [])
    until, until_reasons = _check_strings([until_value] if isinstance(until_value, str) else until_value,
                                          "until", least=0)
    max_gen = row.get("max_gen_toks")
    if max_gen is not None and (isinstance(max_gen, bool) or not isinstance(max_gen, int) or max_gen < 1):
        reasons.append(f"max_gen_toks must be a positive integer, got {show(max_gen)}")
    reasons += target_reasons + until_reasons
    fields = {"prompt": prompt, "messages": messages, "targets": targets, "until": until, "max_gen_toks": max_gen}
    return fields, reasons


def _check_messages(value: object) -> tuple[tuple[dict, ...] | None, list[str]]:
    if not isinstance(value, list) or not value:
        return None, [f"messages must be a non-empty array of {{role, content}} objects, got {show(value)}"]
    reasons = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            reasons.append(f"messages[{i}] must be an object with exactly role and content, got {show(message)}")
        elif message["role"] not in MESSAGE_ROLES or not isinstance(message["content"], str):
            reasons.append(f"messages[{i}] needs a role in {', '.join(MESSAGE_ROLES)} and string content, "
                           f"got {show(message)}")
    return (None, reasons) if reasons else (tuple(dict(m) for m in value), [])


_CHECKS = {MULTIPLE_CHOICE: _multiple_choice, LOGLIKELIHOOD: _loglikelihood, ROLLING: _rolling,
           GENERATION: _generation}
