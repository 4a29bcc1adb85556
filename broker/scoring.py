"""How a ScoreRequest goes down the chain: the rows it feeds, in order, and the scores that come back.

A segment's context is prefilled once, all but its last token; then each continuation is fed as
[last context token] + continuation[:-1] from the position of that last token, every position
scored against the next token (the first one predicts continuation[0]). Feeding a continuation
rewinds the slot to the end of the context (stages drop cached keys past a row's start), so the
choices of a question never see each other, and the context costs one prefill, not one per choice.
Re-feeding the last context token costs one position per continuation and keeps every phase a
plain "these positions, these targets" row that any stage already understands.

Pure: no sockets, no clock. The scheduler asks for the next chunk within its token budget and
hands back what the last stage returned.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerbus.broker.requests import ContinuationScore, ScoreRequest


@dataclass(frozen=True)
class Phase:
    """Consecutive positions fed in one or more chunks: a context prefill or one continuation."""

    start: int  # position of tokens[0]
    tokens: tuple[int, ...]
    targets: tuple[int, ...] | None  # next token at each position (continuations), None for a context
    continuation: int | None  # index in the request's flattened continuations


def phases_of(request: ScoreRequest) -> list[Phase]:
    phases, index = [], 0
    for segment in request.segments:
        context = tuple(segment.context_ids)
        if len(context) > 1:
            phases.append(Phase(0, context[:-1], None, None))
        for continuation in segment.continuations:
            continuation = tuple(continuation)
            phases.append(Phase(len(context) - 1, (context[-1],) + continuation[:-1], continuation, index))
            index += 1
    return phases


@dataclass(frozen=True)
class Chunk:
    """The next row to send for a scoring sequence."""

    start: int
    tokens: list[int]
    targets: list[int] | None  # one per token, or None


class ScoringFeed:
    """One ScoreRequest's progress: which phase is next, how far into it, what was scored so far."""

    def __init__(self, request: ScoreRequest):
        self.phases = phases_of(request)
        self.continuations = sum(len(s.continuations) for s in request.segments)
        # Every position the request computes once: its prefill cost, reported as its prompt tokens.
        self.positions = sum(len(p.tokens) for p in self.phases)
        self.restart()

    def restart(self) -> None:
        """From the beginning (the stages lost their caches): scores are recomputed, identically."""
        self.phase, self.offset = 0, 0
        self.logprobs: list[list[float]] = [[] for _ in range(self.continuations)]
        self.greedy: list[list[bool]] = [[] for _ in range(self.continuations)]

    @property
    def done(self) -> bool:
        return self.phase == len(self.phases)

    def opening_context(self) -> list[int] | None:
        """The tokens of the first context phase while nothing of it was fed yet, else None: that phase
        starts at position 0 with nothing to score, like a generation's prompt, so the prefix cache
        (broker/prefix_cache.py) can restore its first blocks and save them for the next request."""
        if self.phase != 0 or self.offset != 0 or not self.phases or self.phases[0].targets is not None:
            return None
        return list(self.phases[0].tokens)

    def skip_restored(self, positions: int) -> None:
        """The first `positions` of the opening context come from a saved prefix, not computed here."""
        if self.opening_context() is None or not 0 < positions < len(self.phases[0].tokens):
            raise ValueError(f"cannot restore {positions} positions of this request's opening context")
        self.offset = positions

    def unskip(self) -> None:
        """The step that restored them failed: the next try computes the opening context from position 0."""
        if self.phase == 0:
            self.offset = 0

    def next_chunk(self, budget: int) -> Chunk:
        """At most `budget` (>= 1) positions of the current phase."""
        phase = self.phases[self.phase]
        end = min(len(phase.tokens), self.offset + max(budget, 1))
        targets = list(phase.targets[self.offset:end]) if phase.targets is not None else None
        return Chunk(phase.start + self.offset, list(phase.tokens[self.offset:end]), targets)

    def apply(self, fed: int, logprobs: list[float] | None, greedy: list[bool] | None) -> None:
        """The chunk of `fed` positions came back, with the scores of its targets when it had any."""
        phase = self.phases[self.phase]
        if phase.targets is not None:
            if logprobs is None or len(logprobs) != fed or greedy is None or len(greedy) != fed:
                raise ValueError(f"the last stage returned {None if logprobs is None else len(logprobs)} scores "
                                 f"for a chunk of {fed} scored positions")
            self.logprobs[phase.continuation].extend(logprobs)
            self.greedy[phase.continuation].extend(greedy)
        self.offset += fed
        if self.offset == len(phase.tokens):
            self.phase, self.offset = self.phase + 1, 0

    def scores(self) -> list[ContinuationScore]:
        return [ContinuationScore(tuple(lp), tuple(g)) for lp, g in zip(self.logprobs, self.greedy)]
