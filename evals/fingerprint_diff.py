"""What differs between two eval runs' fingerprints, sorted into the parts a reader of a regression asks about:
the model's weights, its config, its tokenizer (files and chat template), and the run's settings (dtype,
wire codecs, layerbus version, max_length, limit, few-shot, seed).

The fingerprint is nested JSON (cli/eval_run.py builds it: {"model": models.fingerprint.model_fingerprint,
"dtype", "wire", ...}); it is flattened to dotted paths, so a new key lands in "settings" without a change here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# Dotted path prefixes -> part, first match wins; anything else is a setting.
PARTS = (
    ("model.weights", "model weights"),
    ("model.config", "config"),
    ("model.tokenizer", "tokenizer"),
    ("model.chat_template", "tokenizer"),
)
SETTINGS = "settings"
PART_ORDER = ("model weights", "config", "tokenizer", SETTINGS)
# A value of one run's fingerprint that the other lacks.
ABSENT = "(absent)"
_HEX_DIGEST = re.compile(r"[0-9a-f]{40,}")
# Hex digests are shown by their first digits: enough to tell two apart.
SHORT_HASH = 12


@dataclass(frozen=True)
class FingerprintChange:
    """One leaf of the fingerprint that differs between the runs."""

    # "model weights", "config", "tokenizer" or "settings".
    part: str
    # Dotted path, e.g. "model.weights.model.safetensors" or "wire".
    path: str
    # The value in each run (ABSENT when that run's fingerprint has no such path).
    base: Any
    cand: Any


def fingerprint_changes(base_json: str, cand_json: str) -> list[FingerprintChange]:
    """The differing leaves of two fingerprint JSON texts, by part (PART_ORDER) then path."""
    base, cand = _flatten(json.loads(base_json)), _flatten(json.loads(cand_json))
    changes = [FingerprintChange(part_of(path), path, base.get(path, ABSENT), cand.get(path, ABSENT))
               for path in sorted(set(base) | set(cand)) if base.get(path, ABSENT) != cand.get(path, ABSENT)]
    return sorted(changes, key=lambda c: (PART_ORDER.index(c.part), c.path))


def part_of(path: str) -> str:
    for prefix, part in PARTS:
        if path == prefix or path.startswith(prefix + "."):
            return part
    return SETTINGS


def describe(value: Any) -> str:
    """A value as a short text: JSON, with hex digests cut to SHORT_HASH digits."""
    if value is ABSENT:
        return ABSENT
    return _HEX_DIGEST.sub(lambda m: m.group(0)[:SHORT_HASH], json.dumps(value, sort_keys=True))


def summary(changes: list[FingerprintChange]) -> str:
    """One line: 'model weights (model.safetensors), settings (wire: "float32" -> "int8")', or 'identical'."""
    if not changes:
        return "identical"
    by_part: dict[str, list[str]] = {}
    for change in changes:
        by_part.setdefault(change.part, []).append(_change_text(change))
    return "; ".join(f"{part} ({', '.join(texts)})" for part, texts in by_part.items())


def _change_text(change: FingerprintChange) -> str:
    # Inside "model weights" the file name says which weights; the hashes themselves tell a reader nothing.
    if change.part == "model weights":
        name = change.path.removeprefix("model.weights").lstrip(".") or "weights"
        if ABSENT in (change.base, change.cand):
            return f"{name} {'added' if change.base is ABSENT else 'removed'}"
        return name
    return f"{change.path}: {describe(change.base)} -> {describe(change.cand)}"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, inner in value.items():
            flat.update(_flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}
