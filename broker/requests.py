"""What the broker is asked to generate or score, and what it hands back: the runtime's public values."""

from __future__ import annotations

from dataclasses import dataclass, field

from layerbus.wire.constraint import Constraint
from layerbus.wire.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate."""

    request_id: str  # caller's id (a job item id, a custom_id); returned unchanged
    prompt_ids: list[int]  # the tokenized prompt, special tokens included
    max_new_tokens: int = 128  # generation stops after this many new tokens (finish_reason "length")
    sampling: SamplingParams = field(default_factory=SamplingParams)  # greedy unless temperature > 0
    stop: tuple[str, ...] = ()  # stop strings: generation ends when the output text contains one
    want_logprobs: bool = False  # return the log-probability of every generated token
    top_logprobs: int = 0  # with want_logprobs: also the k most likely tokens at each position (0..20)
    score_prompt: bool = False  # return log P(prompt[i] | prompt[:i]) for i >= 1 (teacher-forced evals)
    constraint: Constraint | None = None  # what the output must match (JSON schema, regex, choice); None: free


@dataclass(frozen=True)
class ScoreSegment:
    """A context and the continuations scored after it, the context computed once for all of them
    (a multiple-choice question's choices share their question)."""

    context_ids: tuple[int, ...]  # >= 1 token; what the continuations are conditioned on
    continuations: tuple[tuple[int, ...], ...]  # each >= 1 token

    def __post_init__(self) -> None:
        if not self.context_ids or not self.continuations or not all(self.continuations):
            raise ValueError(f"a score segment needs a context and continuations of at least one token each, got "
                             f"{len(self.context_ids)} context token(s) and continuation lengths "
                             f"{[len(c) for c in self.continuations]}")


@dataclass(frozen=True)
class ScoreRequest:
    """Teacher-forced scoring (evals): log P(continuation | context) for every continuation of every
    segment, with whether greedy decoding would have produced it. Nothing is generated."""

    request_id: str  # caller's id (a job item id); returned unchanged
    segments: tuple[ScoreSegment, ...]

    @property
    def max_position(self) -> int:
        """Positions the longest continuation reaches: what must fit the context budget."""
        return max(len(s.context_ids) + max(map(len, s.continuations)) - 1 for s in self.segments)


@dataclass(frozen=True)
class ContinuationScore:
    """One scored continuation: per-token log-probabilities and whether each token was the argmax."""

    logprobs: tuple[float, ...]
    greedy: tuple[bool, ...]

    @property
    def ll(self) -> float:
        return sum(self.logprobs)

    @property
    def is_greedy(self) -> bool:
        return all(self.greedy)


@dataclass
class GenerationResult:
    """The outcome of one request; `error` is set (and finish_reason "error") when it failed."""

    request_id: str  # as in the request
    token_ids: list[int]  # generated tokens (a final EOS included, as transformers' generate does)
    finish_reason: str  # "stop" (EOS or stop string), "length", "error" or "cancelled"
    prompt_tokens: int  # prompt length in tokens
    error: str | None = None  # why it failed, when it did
    latency_s: float = 0.0  # admission to finish, as measured by the broker's clock
    logprobs: list[float] | None = None  # per generated token, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per generated token: the k most likely (id, logprob)
    token_texts: dict[int, str] | None = None  # with logprobs: each token id above, decoded alone
    stop_text_end: int | None = None  # where a matched stop string begins in the decoded output
    text: str | None = None  # the output text, cut before a matched stop string (None: no tokenizer given)
    prompt_logprobs: list[float] | None = None  # with score_prompt: one per prompt token after the first
    prompt_ids: list[int] | None = None  # with score_prompt: the prompt's tokens, which those log-probs are of
    scores: list[ContinuationScore] | None = None  # a ScoreRequest's continuations, segments flattened in order

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
