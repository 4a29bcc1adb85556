"""Constrained decoding as both sides speak it: what an item's output must match (a `Constraint`, kept in
the item's params and the request), and the token mask a step row carries to the last stage.

The broker holds each constrained sequence's grammar state (broker/grammar.py) and sends, with every
emitting row, the set of tokens the grammar allows next; the last stage only masks its logits with it
(stages/sampling.py). Pure standard library: the mask is the grammar engine's bitmask (bit t of byte
t // 8 set when token t is allowed, least significant bit first), deflated and base64-encoded, because
step rows are JSON and an allow-mask is mostly runs of ones or zeros (6 KiB raw for a 49k vocabulary,
typically a few hundred bytes deflated).
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass
from typing import Any

# The kinds a constraint may be, and the field of its JSON form holding its value.
KINDS = {"json_schema": "schema", "json_object": None, "regex": "pattern", "choice": "choices"}
# The step row's sampling key carrying the mask (wire/sampling.py's keys are one letter too).
MASK_KEY = "m"


@dataclass(frozen=True)
class Constraint:
    """What one item's generated text must be: JSON valid against a schema, any JSON object, a full match
    of a regex, or exactly one of a list of strings. Hashable, so compiled grammars are cached by it."""

    kind: str  # one of KINDS
    value: str = ""  # the schema as canonical JSON text, the regex, or the choices as a JSON array; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict) -> "Constraint":
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: list[str]) -> "Constraint":
        return cls("choice", json.dumps(list(choices), separators=(",", ":")))

    @property
    def schema(self) -> dict:
        """The JSON schema the output must validate against (json_object: any object)."""
        return json.loads(self.value) if self.kind == "json_schema" else {"type": "object"}

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value) if self.kind == "choice" else []

    def to_json(self) -> dict[str, Any]:
        """The form stored in an item's params and a job's settings."""
        field = KINDS[self.kind]
        if field is None:
            return {"type": self.kind}
        value = self.value if self.kind == "regex" else json.loads(self.value)
        return {"type": self.kind, field: value}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "Constraint":
        kind = value.get("type")
        if kind == "json_schema":
            return cls.json_schema(value["schema"])
        if kind == "choice":
            return cls.choice(value["choices"])
        if kind == "regex":
            return cls("regex", value["pattern"])
        return cls(str(kind))


def pack_mask(bitmask: bytes) -> str:
    """The engine's allow-bitmask in the form a step row carries."""
    return base64.b64encode(zlib.compress(bitmask, 1)).decode("ascii")


def unpack_mask(text: str, max_bytes: int = 1 << 20) -> bytes:
    """The bitmask a step row carries; ValueError for anything that is not one (a hostile row cannot inflate
    it past max_bytes: a vocabulary of 8 million tokens)."""
    if not isinstance(text, str):
        raise ValueError(f"a token mask must be a base64 string, got {type(text).__name__}")
    try:
        inflater = zlib.decompressobj()
        bitmask = inflater.decompress(base64.b64decode(text, validate=True), max_bytes)
    except (ValueError, zlib.error) as error:
        raise ValueError(f"unreadable token mask ({error})") from None
    if inflater.unconsumed_tail:
        raise ValueError(f"token mask inflates past {max_bytes} bytes")
    return bitmask
