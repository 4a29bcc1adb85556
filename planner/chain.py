"""The chain in use as one immutable value: which stages in which order, the layers each holds, the
codec of each link between them, and the plan it came from. The broker owns the one current
`Placement` and swaps it whole on a re-plan; everything else reads it from there."""

from __future__ import annotations

from dataclasses import dataclass

from layerbus.planner.placement import Plan
from layerbus.wire.spans import LayerRange, format_chain


@dataclass(frozen=True)
class Placement:
    """A chain of stages with their spans and link codecs."""

    stages: tuple[str, ...]  # stage names in chain order: the first embeds, the last runs the head
    spans: tuple[LayerRange, ...]  # the layers of each stage, contiguous from 0 to the model's last
    codecs: tuple[str, ...] = ()  # the codec of each link, stage i -> stage i + 1
    partition: str = "planned"  # how the spans were chosen: "planned", "balanced" or "equal"
    plan: Plan | None = None  # the planner's figures ("planned"); None for "balanced" and "equal"

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a placement needs at least one stage")
        if len(self.spans) != len(self.stages):
            raise ValueError(f"{len(self.stages)=} stages but {len(self.spans)=} spans")
        if len(set(self.stages)) != len(self.stages):
            raise ValueError(f"stage names must be unique in a chain, got {self.stages}")
        for before, after in zip(self.spans, self.spans[1:]):
            if before.end != after.start:
                raise ValueError(f"spans must be contiguous, got {before} then {after}")
        if self.codecs and len(self.codecs) != len(self.stages) - 1:
            raise ValueError(f"{len(self.stages)} stages have {len(self.stages) - 1} links, got {len(self.codecs)=}")

    def with_codecs(self, codecs: list[str] | tuple[str, ...]) -> "Placement":
        return Placement(self.stages, self.spans, tuple(codecs), self.partition, self.plan)

    def span_of(self, name: str) -> LayerRange | None:
        """The layers of this stage, or None when it is not in the chain."""
        return self.spans[self.stages.index(name)] if name in self.stages else None

    def text(self) -> str:
        """"stage-1 [0, 24) -int8-> stage-0 [24, 30)"."""
        return format_chain(self.stages, self.spans, self.codecs)

    def summary(self) -> str:
        """The chain with how it was chosen, e.g. "... (planned; predicted 41.0 tok/s)" (the job's events)."""
        predicted = f"; predicted {self.plan.tokens_per_s:.1f} tok/s" if self.plan is not None else ""
        return f"{self.text()} ({self.partition}{predicted})"

    def run_info(self) -> dict:
        """For storage.run_info: the chain, its spans and the codec of each link."""
        return {"stages": [{"name": name, "layers": str(span)} for name, span in zip(self.stages, self.spans)],
                "wire": [{"from": a, "to": b, "codec": codec}
                         for a, b, codec in zip(self.stages, self.stages[1:], self.codecs)]}
