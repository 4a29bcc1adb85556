"""What the broker is asked to generate, and what it hands back: the runtime's public values."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    score_prompt: bool = False  # return log P(prompt[i] | prompt[:i]) for i >= 1 (teacher-forced evals)


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
    stop_text_end: int | None = None  # where a matched stop string begins in the decoded output
    text: str | None = None  # the output text, cut before a matched stop string (None: no tokenizer given)
    prompt_logprobs: list[float] | None = None  # with score_prompt: one per prompt token after the first

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
