"""Telling a stage that has slowed down (a card throttling, a neighbour on its host) from a change in
the work: pure bookkeeping over the stages' own heartbeat stats, table-tested.

Each stage reports its busy seconds and steps served. Over windows of `window_s`, the broker takes
each stage's busy seconds per step. The first full window after a plan is that plan's baseline:
how fast each stage runs its span on this workload, measured rather than predicted (profiles are
taken before the job and can be off by a fair margin). A later window's ratio to the baseline is
divided by the smallest ratio of all stages, because a change in the work (longer contexts, more
prefill) slows every stage alike, while a slowed device slows one. A stage whose relative ratio
reaches `threshold` for `windows` windows in a row is slowed by that factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class DriftConfig:
    """When a slowed stage makes the broker move layers off it."""

    enabled: bool = True
    window_s: float = 5.0  # measure each stage's busy seconds per step over windows this long
    threshold: float = 2.0  # slowed: this many times slower than its baseline, relative to the others
    windows: int = 2  # ... in this many windows in a row
    min_steps: int = 4  # a window where a stage served fewer steps says nothing about it
    min_gain: float = 0.15  # move layers only if the new plan's predicted step is this much faster

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.threshold <= 1 or self.windows < 1 or self.min_steps < 1:
            raise ValueError(f"need window_s > 0, threshold > 1, windows >= 1 and min_steps >= 1, got {self}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")


def relative_slowdowns(baseline: Mapping[str, float], current: Mapping[str, float]) -> dict[str, float]:
    """Each stage's (current / baseline) time per step, divided by the smallest such ratio."""
    ratios = {name: current[name] / baseline[name] for name in current
              if baseline.get(name, 0) > 0 and current[name] > 0}
    if not ratios:
        return {}
    floor = min(ratios.values())
    return {name: ratio / floor for name, ratio in ratios.items()}


class DriftWatch:
    """Feed it the stages' stats; it answers {stage: factor} once a stage has stayed slowed."""

    def __init__(self, config: DriftConfig):
        self.config = config
        self.restart(0.0, {})

    def restart(self, now: float, stats: Mapping[str, Mapping]) -> None:
        """A new plan (or a re-plan): its baseline is measured anew."""
        self.window_start, self.start_stats = now, {name: dict(s) for name, s in stats.items()}
        self.baseline: dict[str, float] | None = None
        self.strikes: dict[str, int] = {}

    def observe(self, now: float, stats: Mapping[str, Mapping]) -> dict[str, float] | None:
        """`stats`: stage name -> its latest {busy_s, steps}. Returns the slowed stages, or None."""
        if not self.config.enabled or now - self.window_start < self.config.window_s:
            return None
        per_step = {}
        for name, latest in stats.items():
            before = self.start_stats.get(name, {})
            steps = latest.get("steps", 0) - before.get("steps", 0)
            if steps < self.config.min_steps:
                self.window_start, self.start_stats = now, {n: dict(s) for n, s in stats.items()}
                return None  # too little work in this window to judge anyone (a drain, a pause)
            per_step[name] = (latest.get("busy_s", 0.0) - before.get("busy_s", 0.0)) / steps
        self.window_start, self.start_stats = now, {name: dict(s) for name, s in stats.items()}
        if self.baseline is None:
            self.baseline = per_step
            return None
        factors = relative_slowdowns(self.baseline, per_step)
        for name, factor in factors.items():
            self.strikes[name] = self.strikes.get(name, 0) + 1 if factor >= self.config.threshold else 0
        slowed = {name: factors[name] for name, strikes in self.strikes.items() if strikes >= self.config.windows}
        return slowed or None
