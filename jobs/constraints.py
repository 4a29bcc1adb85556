"""What an item's output must match, as the user gives it: an OpenAI `response_format` (json_schema or
json_object) or vLLM's `guided_regex` / `guided_choice` on a batch line, or `--json-schema FILE`,
`--regex R`, `--choices A,B,C` for the whole job. Checked here, at submit, by compiling it with the grammar
engine (broker/grammar.py, imported only when an item or the job has a constraint), so a schema the engine
cannot compile is refused with its file:line instead of failing its items at run time.

Stored as the constraint's JSON form (wire/constraint.py): in the item's params under CONSTRAINT_KEY, or the
job's settings.extra under the same key; an item's own wins over the job's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerbus.jobs.item_checks import show, type_name
from layerbus.wire.constraint import Constraint

CONSTRAINT_KEY = "constraint"
# Keys of a body that constrain its output (vLLM's extra parameters for the last two).
BODY_CONSTRAINT_KEYS = ("response_format", "guided_regex", "guided_choice")
# Keys of response_format.json_schema in OpenAI's format; only "schema" constrains.
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def compile_problem(constraint: Constraint) -> str | None:
    from layerbus.broker.grammar import check_constraint  # the grammar engine: only where a constraint is given

    return check_constraint(constraint)


def check_body_constraint(body: dict[str, Any], where: str = "body.") -> tuple[dict | None, list[str]]:
    """The constraint a batch line's body gives (its stored JSON form), or None; reasons when it is refused."""
    given = [key for key in BODY_CONSTRAINT_KEYS if key in body and not (key == "response_format"
                                                                          and _is_text_format(body[key]))]
    if not given:
        return None, []
    if len(given) > 1:
        return None, [f"{', '.join(where + key for key in given)}: give one of them, not several (an output "
                      "matches one constraint)"]
    key = given[0]
    constraint, reason = _parse(key, body[key], f"{where}{key}")
    if reason is None:
        problem = compile_problem(constraint)
        reason = f"{where}{key} does not compile: {problem}" if problem else None
    return (None, [reason]) if reason else (constraint.to_json(), [])


def _is_text_format(value: object) -> bool:
    return isinstance(value, dict) and value == {"type": "text"}  # OpenAI's default: no constraint


def _parse(key: str, value: object, where: str) -> tuple[Constraint | None, str | None]:
    if key == "guided_regex":
        if not isinstance(value, str) or not value:
            return None, f"{where} must be a non-empty regular expression string, got {show(value)}"
        return Constraint("regex", value), None
    if key == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            return None, f"{where} must be a non-empty array of non-empty strings, got {show(value)}"
        return Constraint.choice(value), None
    if not isinstance(value, dict):
        return None, f"{where} must be an object such as {{\"type\": \"json_object\"}}, got {type_name(value)}"
    kind = value.get("type")
    if kind == "json_object" and set(value) == {"type"}:
        return Constraint("json_object"), None
    if kind != "json_schema":
        return None, (f"{where}.type must be \"json_schema\", \"json_object\" or \"text\" (with no other keys), "
                      f"got {show(kind)}")
    spec = value.get("json_schema")
    unknown = sorted(set(value) - {"type", "json_schema"})
    if unknown or not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        return None, (f"{where} of type json_schema needs json_schema: {{\"name\": ..., \"schema\": {{...}}}}"
                      + (f"; unknown key(s) {', '.join(unknown)}" if unknown else ""))
    extra = sorted(set(spec) - set(JSON_SCHEMA_KEYS))
    if extra:
        return None, f"{where}.json_schema has unknown key(s) {', '.join(extra)}; accepted: {', '.join(JSON_SCHEMA_KEYS)}"
    return Constraint.json_schema(spec["schema"]), None


def job_constraint(json_schema: str | None, regex: str | None, choices: str | None) -> dict | None:
    """The job-wide constraint `--json-schema FILE`, `--regex R` or `--choices A,B,C` give (its stored JSON form);
    ValueError naming the file:line or the value when it is unreadable or does not compile."""
    given = [name for name, value in (("--json-schema", json_schema), ("--regex", regex), ("--choices", choices))
             if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(given)}: an output matches one constraint")
    if json_schema is not None:
        constraint, where = Constraint.json_schema(_read_schema(Path(json_schema))), json_schema
    elif regex is not None:
        constraint, where = Constraint("regex", regex), f"--regex {regex!r}"
    else:
        options = [c.strip() for c in choices.split(",")]
        if not all(options):
            raise ValueError(f"--choices {choices!r} has an empty choice: give A,B,C")
        constraint, where = Constraint.choice(options), f"--choices {choices!r}"
    problem = compile_problem(constraint)
    if problem:
        raise ValueError(f"{where}: does not compile: {problem}")
    return constraint.to_json()


def _read_schema(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--json-schema {path}: cannot read it ({error})") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}:{error.colno}: not JSON: {error.msg}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{path}:1: a JSON schema must be an object, got {type_name(schema)}")
    # OpenAI's response_format.json_schema wrapper is accepted as is: the schema is inside it.
    if set(schema) <= set(JSON_SCHEMA_KEYS) and isinstance(schema.get("schema"), dict):
        schema = schema["schema"]
    return schema


def constraint_of(params: dict[str, Any], job_extra: dict[str, Any]) -> Constraint | None:
    """The constraint an item runs under: its own, else the job's, else None."""
    value = params.get(CONSTRAINT_KEY, job_extra.get(CONSTRAINT_KEY))
    return Constraint.from_json(value) if value else None
