"""The broker's side of speculative decoding: which drafts each decode row carries, and what they gave.

A decode row with k drafts carries its last token and the k drafts, k + 1 positions down the chain in the same
packed step as the other rows. The last stage picks the token at each position with the sampler it always uses
(a function of the logits, the item's seed and the position) and accepts drafts while each equals its pick, so the
tokens are those of a run without drafts, greedy or sampled. This module keeps the drafter, the measured
acceptance and trip times, and asks the planner (planner.speculation) how far to draft each step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from layerbus.broker.drafting import SequenceLookup, new_drafter
from layerbus.broker.sequences import PlannedRow
from layerbus.planner.speculation import (
    DraftChoice,
    SpeculationConfig,
    choose_draft_length,
    estimated_acceptance,
    expected_tokens,
    fit_trip_cost,
)

if TYPE_CHECKING:
    from layerbus.broker.sequences import Sequence

TRIP_SAMPLES = 64  # recent steps the trip cost is fitted over


@dataclass
class SpeculationStats:
    """What drafting did in a run: the figures `status`, the metrics and the benchmark show."""

    proposed: int = 0  # draft tokens sent to be verified
    accepted: int = 0  # of which the last stage accepted
    verify_rows: int = 0  # rows that carried drafts
    missed: int = 0  # of which ended on a rejected draft
    trips: int = 0  # decode rows sent (with or without drafts): trips a sequence made down the chain
    tokens: int = 0  # tokens those trips yielded
    last_drafts: int = 0  # the k chosen for the latest step
    predicted_speedup: float = 1.0  # the planner's expected gain for that k

    def to_json(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "verify_rows": self.verify_rows,
                "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else 0.0,
                "trips": self.trips, "tokens": self.tokens,
                "tokens_per_trip": round(self.tokens / self.trips, 4) if self.trips else 0.0,
                "last_drafts": self.last_drafts, "predicted_speedup": round(self.predicted_speedup, 4)}


class Speculation:
    """Drafts for decode rows, within a config; off when the config says so."""

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.drafter = new_drafter(config.mode, config.min_match, config.max_match)
        self.stats = SpeculationStats()
        self.samples: deque[tuple[int, float]] = deque(maxlen=TRIP_SAMPLES)  # (positions, trip seconds)

    @property
    def enabled(self) -> bool:
        return self.drafter is not None

    def draft_length(self, rows: int, positions: int) -> DraftChoice:
        """How many drafts each of a step's `rows` decode rows carries (the step carries `positions` without
        them). Until trips of two sizes were timed, auto drafts nothing and an explicit drafter drafts its most."""
        floor = 0 if self.config.mode == "auto" else 1
        cost = fit_trip_cost(list(self.samples))
        acceptance = estimated_acceptance(self.stats.accepted, self.stats.missed)
        if cost is None:
            k = 0 if self.config.mode == "auto" else self.config.max_draft
            choice = DraftChoice(k, expected_tokens(acceptance, k), 1.0)
        else:
            choice = choose_draft_length(acceptance, cost, rows, positions, self.config.max_draft, floor)
        self.stats.last_drafts, self.stats.predicted_speedup = choice.drafts, choice.speedup
        return choice

    def drafts(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` drafts to follow the sequence's tokens so far."""
        if limit <= 0:
            return []
        lookup = seq.lookup
        if lookup is None:
            lookup = seq.lookup = SequenceLookup(list(seq.request.prompt_ids), self.config.min_match,
                                                 self.config.max_match)
        known = len(seq.request.prompt_ids) + len(seq.generated)
        if len(lookup.tokens) < known:
            lookup.extend(seq.generated[len(lookup.tokens) - len(seq.request.prompt_ids):])
        return self.drafter.propose(lookup, limit)

    def verified(self, drafts: int, accepted: int, tokens: int) -> None:
        """A decode row came back: `accepted` of its `drafts` drafts were taken, and `tokens` tokens kept."""
        self.stats.trips += 1
        self.stats.tokens += tokens
        if drafts:
            self.stats.proposed += drafts
            self.stats.accepted += accepted
            self.stats.verify_rows += 1
            self.stats.missed += accepted < drafts

    def trip(self, positions: int, seconds: float) -> None:
        """A step of `positions` positions came back `seconds` after it was sent."""
        self.samples.append((positions, seconds))

    def finished(self, seq: Sequence) -> None:
        if self.drafter is not None and seq.feed is None:
            self.drafter.finished(list(seq.generated))
        seq.lookup = None

    def decode_rows(self, decoding: list[Sequence], positions: int, eos_ids: set[int],
                    max_context: int) -> list[PlannedRow]:
        """A decode row for each sequence, with its drafts: as many as the planner chose for the step, fewer where
        the drafter has fewer, the output budget or the context ends sooner, a draft is an end-of-sequence token or
        the sequence's grammar forbids one (a draft the mask forbids could never be accepted)."""
        k = self.draft_length(len(decoding), positions).drafts if self.enabled and decoding else 0
        rows = []
        for seq in decoding:
            fed = [seq.generated[-1]]
            known = len(seq.request.prompt_ids) + len(seq.generated)
            limit = min(k, seq.request.max_new_tokens - len(seq.generated) - 1, max_context - known - 1)
            drafts = self.drafts(seq, limit) if limit > 0 and seq.stop_at is None else []
            drafts = drafts[:next((i for i, t in enumerate(drafts) if t in eos_ids), len(drafts))]
            masks: list[bytes] = []
            if drafts and seq.grammar is not None:
                allowed, masks = seq.grammar.lookahead(drafts)
                drafts = drafts[:allowed]
            rows.append(PlannedRow(seq.slot, seq.cached, fed + drafts, emit=True, drafts=len(drafts),
                                   draft_masks=tuple(masks)))
        return rows


def taken_tokens(row: PlannedRow, token: tuple, accepted: list | None) -> list[tuple]:
    """The tokens a decode row yielded, in order: the drafts the last stage accepted (each entry (token,
    logprob[, top])), checked against what was drafted, then the token it picked after them."""
    taken = []
    for entry, draft in zip(accepted or [], row.tokens[1:1 + row.drafts]):
        if entry[0] != draft:
            break
        taken.append(tuple(entry))
    return taken + [token]
