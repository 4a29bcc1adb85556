"""A sequence in its slot, and the rows of a step: what the scheduler (broker/scheduler.py) keeps of each
request, and what a step sends. Pure values and the two rules a step's rows follow: where a chunk of known
tokens is cut, and what prefix a chunk saves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.broker.prefix_cache import PrefixPlan
from layerbus.broker.requests import GenerationRequest, ScoreRequest
from layerbus.broker.scoring import ScoringFeed

if TYPE_CHECKING:
    from layerbus.broker.grammar import TokenGrammar

Request = GenerationRequest | ScoreRequest


@dataclass
class Sequence:
    """A request in a slot: its prompt, what is cached on the stages, what it has generated (or, for
    a ScoreRequest, its feed: the phases to send and the scores so far)."""

    request: Request
    slot: int
    admitted_at: float
    # The micro-batch whose steps carry it: its slot's at admission; at a job's tail the scheduler may move
    # it to another (Scheduler._balance_tail). Stages key caches by slot only, so a move is bookkeeping.
    micro_batch: int = 0
    cached: int = 0  # tokens whose keys/values every stage holds
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # with request.top_logprobs
    prompt_logprobs: list[float] = field(default_factory=list)
    failures: int = 0  # steps with only this sequence that a stage failed to run
    suspect: bool = False  # in a failed step: runs alone until a step with it succeeds
    detokenizer: IncrementalDetokenizer | None = None  # the output text as it grows (None: no tokenizer given)
    stop_at: int | None = None  # where the first stop string found in the output text begins
    feed: ScoringFeed | None = None  # a ScoreRequest's progress (None: a generation)
    prefix: PrefixPlan | None = None  # what its prefill restores and saves (None: not planned yet, or no cache)
    prefix_hashes: list[bytes] | None = None  # its prompt's block hashes, once the cache has looked
    grammar: TokenGrammar | None = None  # a constrained request's grammar state (None: unconstrained)
    # After a re-plan that kept caches (Scheduler.replay_layers): the positions [cached, replay_end) still
    # to replay over the window's layers before anything else runs for it (None: not replaying).
    replay_end: int | None = None

    @property
    def known(self) -> list[int]:
        """The tokens whose keys/values the stages must hold before the next decode: the prompt, plus
        every generated token but the last (which the next decode step feeds)."""
        return self.request.prompt_ids + self.generated[:-1] if self.generated else self.request.prompt_ids

    @property
    def prefilling(self) -> bool:
        """Still filling the stages' caches: the prompt at first, or all known tokens after a
        recovery emptied them (see Scheduler.reset_caches). A scoring sequence only ever prefills."""
        if self.feed is not None:
            return not self.feed.done
        return self.cached < len(self.request.prompt_ids) + max(len(self.generated) - 1, 0)


@dataclass(frozen=True)
class PlannedRow:
    slot: int
    start: int  # position of the first token sent
    tokens: list[int]  # token ids fed to the first stage
    emit: bool  # the last stage returns a token for this row
    targets: list[int] | None = None  # next prompt tokens to score (score_prompt requests)
    restore: tuple[int, int] | None = None  # (prefix entry, positions) copied into the slot before computing
    save: tuple[int, int] | None = None  # (prefix entry, positions) copied out of the slot once computed


@dataclass(frozen=True)
class StepPlan:
    """One micro-batch step: its rows and the slots whose caches the stages may drop."""

    micro_batch: int
    rows: list[PlannedRow]
    released: list[int]
    dropped_prefixes: list[int] = field(default_factory=list)  # prefix entries the stages may free
    # A replay step (Scheduler.replay_layers): the stages run only these layers [w0, w1), and emit nothing.
    window: tuple[int, int] | None = None


def _carries_a_chunk(rows: list[PlannedRow]) -> bool:
    """The step has a chunk of several positions already: another that does not fit the budget waits."""
    return any(len(row.tokens) > 1 for row in rows)


def prefill_chunk_end(start: int, prompt_length: int, chunk_tokens: int) -> int:
    """Where a chunk of a sequence's known tokens that starts at `start` ends. Within the prompt: at the next
    multiple of `chunk_tokens` (the step budget) or the prompt's end, so the prompt is cut at the same places
    whatever else shares the step, in a re-prefill after a re-plan, and in a rerun; past it (the tokens it
    generated, recomputed after a re-plan): one position, as the decode step that first computed it. A
    position's keys and values are then the very bits an uninterrupted run computes (a kernel given another
    cut rounds differently), so a later greedy token never flips where the model's two best tokens are within
    float rounding of each other (a soak of 3,000 items met one 2e-6 apart)."""
    if start < prompt_length:
        return min(prompt_length, (start // chunk_tokens + 1) * chunk_tokens)
    return start + 1


def _save_reached(seq: Sequence, end: int) -> tuple[int, int] | None:
    """The prefix save a row ending at position `end` carries: the sequence's pending one, once its chunk reaches it."""
    save = seq.prefix.save if seq.prefix is not None else None
    return save if save is not None and save[1] <= end else None
