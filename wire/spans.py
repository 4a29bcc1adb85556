"""A layer span: the half-open range of decoder layers `[start, end)` that one stage holds."""

from __future__ import annotations

from dataclasses import dataclass


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
