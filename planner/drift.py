"""Telling a stage that has slowed down (a card throttling, a neighbour on its host) from a change in
the work: pure bookkeeping over the stages' own heartbeat stats, table-tested.

Each stage reports its busy seconds and steps served. Over windows of `window_s`, the broker
compares each stage's busy seconds with the work it was sent, priced by that stage's profile
(`expected`: decode rows, prefill tokens and emitted rows cost differently, and a job moves from
mostly prefill to mostly decode, which shifts the load between stages by 2x and more). Without
profiles the work is counted in steps. The first full window after a plan is that plan's baseline:
the profiles are taken before the job and can be off by a fair margin, so each stage is compared
with itself. A later window's ratio to the baseline is divided by the smallest ratio of all stages,
because what slows every stage alike (the host, longer contexts) is not a slowed device. A stage
whose relative ratio reaches `threshold` for `windows` windows in a row is slowed by that factor.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Mapping


@dataclass(frozen=True)
class Work:
    """What the broker has sent down the chain so far (cumulative counters)."""

    steps: int = 0
    decode_rows: int = 0  # rows of one new token
    prefill_tokens: int = 0  # tokens of prefill chunks (prompts, re-prefills)
    emit_rows: int = 0  # rows whose next token the last stage picks

    def __sub__(self, other: "Work") -> "Work":
        return Work(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


# expected(stage name, work) -> the seconds that stage's profile says the work takes.
Expected = Callable[[str, Work], float]


@dataclass(frozen=True)
class DriftConfig:
    """When a slowed stage makes the broker move layers off it."""

    enabled: bool = True
    window_s: float = 5.0  # measure each stage's busy seconds per step over windows this long
    # Slowed: this many times slower than its baseline, relative to the others, in `windows` windows
    # in a row. Profiles price prefill and decode only roughly, and stages sharing a host's cores
    # slow each other unevenly: on 2 cores, 3 stages measured 2.7x for a stage nothing happened to.
    threshold: float = 3.0
    windows: int = 3
    min_steps: int = 4  # a window where a stage served fewer steps says nothing about it
    min_gain: float = 0.15  # move layers only if the new plan's predicted step is this much faster
    # CPU stages on one host share its cores and memory bandwidth: one of them running slower is the
    # others' load, which moving layers between them does not cure (and each move costs a re-prefill).
    # Watched only when asked (tests and emulations of a slowed device on one machine).
    watch_shared_cpu_host: bool = False

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

    def __init__(self, config: DriftConfig, expected: Expected | None = None):
        self.config = config
        self.expected = expected  # None: every step is priced alike
        self.restart(0.0, {}, Work())

    def restart(self, now: float, stats: Mapping[str, Mapping], work: Work, expected: Expected | None = None) -> None:
        """A new plan (or a re-plan, with its own prices): its baseline is measured anew."""
        self.window_start, self.start_stats, self.start_work = now, {name: dict(s) for name, s in stats.items()}, work
        self.expected = expected if expected is not None else self.expected
        self.baseline: dict[str, float] | None = None
        self.strikes: dict[str, int] = {}

    def observe(self, now: float, stats: Mapping[str, Mapping], work: Work = Work()) -> dict[str, float] | None:
        """`stats`: stage name -> its latest {busy_s, steps}; `work`: what was sent so far. Returns
        the slowed stages, or None."""
        if not self.config.enabled or now - self.window_start < self.config.window_s:
            return None
        sent = work - self.start_work
        ratios = {}
        for name, latest in stats.items():
            before = self.start_stats.get(name, {})
            steps = latest.get("steps", 0) - before.get("steps", 0)
            if steps < self.config.min_steps:
                self._next_window(now, stats, work)
                return None  # too little work in this window to judge anyone (a drain, a pause)
            price = self.expected(name, sent) if self.expected is not None else 0.0
            if price <= 0:  # no profile to price the work with: count steps
                price = float(steps)
            ratios[name] = (latest.get("busy_s", 0.0) - before.get("busy_s", 0.0)) / price
        self._next_window(now, stats, work)
        if self.baseline is None:
            self.baseline = ratios
            return None
        factors = relative_slowdowns(self.baseline, ratios)
        for name, factor in factors.items():
            self.strikes[name] = self.strikes.get(name, 0) + 1 if factor >= self.config.threshold else 0
        slowed = {name: factors[name] for name, strikes in self.strikes.items() if strikes >= self.config.windows}
        return slowed or None

    def _next_window(self, now: float, stats: Mapping[str, Mapping], work: Work) -> None:
        self.window_start, self.start_stats, self.start_work = now, {n: dict(s) for n, s in stats.items()}, work
