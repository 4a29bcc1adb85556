"""How far to draft: the choice of k, the draft tokens a decode row carries for the last stage to verify.

A decode row with k drafts goes down the chain as k + 1 positions; the last stage accepts drafts while each
equals the token it picks anyway, so a trip yields between 1 and k + 1 tokens. With a per-draft acceptance
rate a (drafts accepted one after another until the first miss), a trip yields (1 - a^(k+1)) / (1 - a) tokens
on average. Each extra position costs every stage compute; each trip costs the chain's fixed time (links,
per-step overheads) once. So few rows or slow links favour drafting far, and full micro-batches of
compute-bound stages favour little or none. Pure functions, no clocks: the broker measures and passes in.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECULATE_MODES = ("auto", "off", "ngram", "suffix")
MAX_DRAFT_TOKENS = 8  # drafts per row at most: past this even a perfect drafter gains little per trip


@dataclass(frozen=True)
class SpeculationConfig:
    """What the broker drafts with and how far."""

    # auto: prompt lookup, then the job's own outputs, k chosen per step (0 included); ngram / suffix: that
    # drafter only, at least one draft wherever it has one; off: never.
    mode: str = "off"
    max_draft: int = 4  # k at most
    min_match: int = 1  # the shortest n-gram the drafters look up
    max_match: int = 4  # the longest n-gram the drafters look up (longer matches are tried first)

    def __post_init__(self) -> None:
        if self.mode not in SPECULATE_MODES:
            raise ValueError(f"speculation mode must be one of {', '.join(SPECULATE_MODES)}, got {self.mode!r}")
        if not 1 <= self.max_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_draft must be in [1, {MAX_DRAFT_TOKENS}], got {self.max_draft}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def parse_speculate(text: str) -> SpeculationConfig:
    """--speculate's value as a config; ValueError naming the value and the choices."""
    value = text.strip()
    if value.startswith("model:"):
        raise ValueError(f"--speculate {value}: draft models are not available yet; use auto, ngram or suffix "
                         "(they draft from the prompt and the job's outputs, with no second model)")
    if value not in SPECULATE_MODES:
        raise ValueError(f"--speculate {value!r}: choose one of {', '.join(SPECULATE_MODES)} (or model:DIR)")
    return SpeculationConfig(mode=value)


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens one trip yields on average with `drafts` drafts, each accepted with probability `acceptance`
    once those before it were: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(drafts + 1))


@dataclass(frozen=True)
class TripCost:
    """Seconds one micro-batch's trip down the chain and back takes: fixed plus per position it carries."""

    fixed_s: float  # links, per-step overheads, the broker's own turn
    per_position_s: float  # every stage's compute per position (decode rows, drafts, prefill tokens)

    def of(self, positions: float) -> float:
        return self.fixed_s + self.per_position_s * positions


@dataclass(frozen=True)
class DraftChoice:
    """The draft length chosen for a step and what it is expected to give."""

    drafts: int  # k
    tokens_per_trip: float  # expected tokens per drafted row per trip
    speedup: float  # expected tokens per second of chain time against k = 0


def choose_draft_length(acceptance: float, cost: TripCost, rows: int, positions: int, max_draft: int,
                        min_draft: int = 0) -> DraftChoice:
    """The k in [min_draft, max_draft] that gives the most expected tokens per second of chain time for a step
    of `rows` rows that could draft, carrying `positions` positions without drafts (their decode rows and any
    prefill chunks). The smallest k wins a tie."""
    if rows <= 0 or max_draft <= 0:
        return DraftChoice(0, 1.0, 1.0)
    base = rows / max(cost.of(positions), 1e-12)
    best = None
    for k in range(min_draft, max_draft + 1):
        rate = rows * expected_tokens(acceptance, k) / max(cost.of(positions + rows * k), 1e-12)
        if best is None or rate > best[1] * (1 + 1e-9):
            best = (k, rate)
    k, rate = best
    return DraftChoice(k, expected_tokens(acceptance, k), rate / base)


def estimated_acceptance(accepted: int, missed: int, prior_accepted: float = 1.0, prior_missed: float = 1.0) -> float:
    """Per-draft acceptance from what verification showed: `accepted` drafts taken, `missed` rows whose drafts
    ran out on a rejection (each a failed trial; drafts after it were never tried). A Beta prior keeps the
    first steps from deciding on one or two rows."""
    return (accepted + prior_accepted) / (accepted + missed + prior_accepted + prior_missed)


def fit_trip_cost(samples: list[tuple[int, float]]) -> TripCost | None:
    """Least-squares fixed and per-position seconds from (positions, trip seconds) of recent steps; None until the
    samples cover at least two position counts. Negative parts (noise) are taken as 0."""
    if len({p for p, _ in samples}) < 2:
        return None
    n = len(samples)
    mean_p = sum(p for p, _ in samples) / n
    mean_s = sum(s for _, s in samples) / n
    spread = sum((p - mean_p) ** 2 for p, _ in samples)
    slope = max(0.0, sum((p - mean_p) * (s - mean_s) for p, s in samples) / spread)
    fixed = max(0.0, mean_s - slope * mean_p)
    return TripCost(fixed, slope)
