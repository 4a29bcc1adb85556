"""JSON Schemas of OpenAI's batch output line and of the two response bodies layerbus
writes, and a check of a pair of output/error files.

Written from OpenAI's documented objects (openapi.yaml: BatchRequestOutput, CreateChatCompletionResponse,
CreateCompletionResponse, CompletionUsage): every field layerbus claims to write is required, with its
documented type, and no field beyond the documented ones is allowed, so a misspelt or invented key fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

FINISH_REASONS = ["stop", "length", "tool_calls", "content_filter", "function_call"]

USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {name: {"type": "integer", "minimum": 0}
                   for name in ("prompt_tokens", "completion_tokens", "total_tokens")},
    "additionalProperties": False,
}

CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string", "pattern": "^chatcmpl-"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer", "minimum": 0},
        "model": {"type": "string", "minLength": 1},
        "system_fingerprint": {"type": ["string", "null"]},
        "service_tier": {"type": ["string", "null"]},
        "usage": USAGE,
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["index", "message", "finish_reason", "logprobs"],
            "properties": {
                "index": {"type": "integer", "minimum": 0},
                "finish_reason": {"enum": FINISH_REASONS},
                "logprobs": {"type": ["object", "null"]},
                "message": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                                   "refusal": {"type": ["string", "null"]}},
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
        }},
    },
    "additionalProperties": False,
}

TEXT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string", "pattern": "^cmpl-"},
        "object": {"const": "text_completion"},
        "created": {"type": "integer", "minimum": 0},
        "model": {"type": "string", "minLength": 1},
        "system_fingerprint": {"type": ["string", "null"]},
        "usage": USAGE,
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["index", "text", "finish_reason", "logprobs"],
            "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                           "finish_reason": {"enum": ["stop", "length", "content_filter"]},
                           "logprobs": {"type": ["object", "null"]}},
            "additionalProperties": False,
        }},
    },
    "additionalProperties": False,
}

OUTPUT_LINE = {
    "type": "object",
    "required": ["id", "custom_id", "response", "error"],
    "properties": {
        "id": {"type": "string", "pattern": "^batch_req_"},
        "custom_id": {"type": "string", "minLength": 1},
        "response": {
            "type": "object",
            "required": ["status_code", "request_id", "body"],
            "properties": {"status_code": {"const": 200}, "request_id": {"type": "string", "minLength": 1},
                           "body": {"oneOf": [CHAT_COMPLETION, TEXT_COMPLETION]}},
            "additionalProperties": False,
        },
        "error": {"type": "null"},
    },
    "additionalProperties": False,
}

ERROR_LINE = {
    "type": "object",
    "required": ["id", "custom_id", "response", "error"],
    "properties": {
        "id": {"type": "string", "pattern": "^batch_req_"},
        "custom_id": {"type": "string", "minLength": 1},
        "response": {"type": "null"},
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string", "minLength": 1}, "message": {"type": "string", "minLength": 1}},
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}


def check_lines(lines: list[dict], schema: dict) -> None:
    for line in lines:
        jsonschema.validate(line, schema)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def check_files(output: Path, errors: Path) -> tuple[list[dict], list[dict]]:
    """Both files' lines, each validated; every custom_id and every line id appears once across the two."""
    done, failed = read_jsonl(output), read_jsonl(errors)
    check_lines(done, OUTPUT_LINE)
    check_lines(failed, ERROR_LINE)
    custom_ids = [line["custom_id"] for line in done + failed]
    assert len(custom_ids) == len(set(custom_ids)), f"a custom_id repeats: {sorted(custom_ids)}"
    ids = [line["id"] for line in done + failed]
    assert len(ids) == len(set(ids)), "a line id repeats"
    return done, failed
