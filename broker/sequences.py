"""A sequence in its slot, and the rows of a step: what the scheduler (broker/scheduler.py) keeps of each
request, and what a step sends. Pure values and the two rules a step's rows follow: where a chunk of known
tokens is cut, and what prefix a chunk saves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.broker.prefix_cache import PrefixPlan
from layerbus.broker.requests import GenerationRequest, GenerationResult, ScoreRequest
from layerbus.broker.scoring import ScoringFeed

if TYPE_CHECKING:
    from layerbus.broker.drafting import SequenceLookup
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
    lookup: SequenceLookup | None = None  # its tokens' n-grams, once a drafter looked (broker/drafting.py)

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
    # Draft tokens after the first (tokens[1:]): the last stage verifies them (broker/speculation.py).
    drafts: int = 0
    # With a grammar: the allow-bitmask at each draft's position, as if the drafts before it were taken.
    draft_masks: tuple[bytes, ...] = ()


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


def read_new_text(seq: Sequence, token: int) -> None:
    """Decode the new token and look for stop strings in the text it changed, plus the
    max(len(stop)) - 1 characters before, where a stop split across tokens begins."""
    stops = [stop for stop in seq.request.stop if stop]
    if seq.detokenizer is None or not stops or seq.stop_at is not None:
        return  # without stop strings the text is needed only at the end: `_finish` decodes it once
    unchanged = seq.detokenizer.add(token)
    start = max(0, unchanged - (max(map(len, stops)) - 1))
    new_text = seq.detokenizer.visible_from(start)
    hits = [start + at for at in (new_text.find(stop) for stop in stops) if at >= 0]
    seq.stop_at = min(hits, default=None)


def _token_texts(seq: Sequence) -> dict[int, str] | None:
    """Each generated and top token (and a scored prompt's tokens) decoded alone, for logprobs' "token" fields
    (None without a tokenizer)."""
    if seq.detokenizer is None:
        return None
    ids = set(seq.generated) | {i for top in seq.top_logprobs for i, _ in top}
    if seq.request.score_prompt:
        ids |= set(seq.request.prompt_ids)
    return {i: seq.detokenizer.tokenizer.decode([i]) for i in sorted(ids)}


def _failed(request: Request, error: str) -> GenerationResult:
    if isinstance(request, ScoreRequest):
        prompt_tokens = ScoringFeed(request).positions if request.segments else 0
    else:
        prompt_tokens = len(request.prompt_ids)
    return GenerationResult(request_id=request.request_id, token_ids=[], finish_reason="error",
                            prompt_tokens=prompt_tokens, error=error)
