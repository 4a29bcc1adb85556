"""A layer span: the half-open range of decoder layers `[start, end)` that one stage holds, and the
text form of a chain of them. Imports nothing of layerbus: the CLI's fast commands use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, order=True)
class LayerRange:
    """Decoder layers `[start, end)`; the first span of a chain also embeds, the last also decodes."""

    start: int  # first layer held
    end: int  # one past the last layer held

    def __post_init__(self) -> None:
        if not (0 <= self.start <= self.end):
            raise ValueError(f"invalid layer range [{self.start}, {self.end}): need 0 <= start <= end")

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    def to_json(self) -> list[int]:
        return [self.start, self.end]

    @classmethod
    def from_json(cls, value: object) -> "LayerRange":
        if (not isinstance(value, list) or len(value) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise ValueError(f"a layer range travels as [start, end], got {value!r:.60}")
        return cls(value[0], value[1])


def format_chain(names: Sequence[str], spans: Sequence[object] | None = None,
                 codecs: Sequence[str | None] = ()) -> str:
    """The chain's one text form, for logs, events, `layerbus status` and `layerbus plan`:
    "stage-1 [0, 24) -int8-> stage-0 [24, 30)". Without spans, names alone ("stage-0 -int8-> stage-1");
    a link without a codec is a plain "->". Spans may be LayerRanges or their text (from JSON)."""
    if spans is not None and len(spans) != len(names):
        raise ValueError(f"{len(names)=} stage names but {len(spans)=} spans")
    parts = []
    for i, name in enumerate(names):
        if i > 0:
            codec = codecs[i - 1] if i - 1 < len(codecs) else None
            parts.append(f"-{codec}->" if codec else "->")
        parts.append(f"{name} {spans[i]}" if spans is not None else name)
    return " ".join(parts)
