"""Next-token choice on the last stage: greedy, or temperature / top-k / top-p with a per-item seed.

A sampled token depends only on (seed, position) and the logits, never on which micro-batch or
stage count produced them, so rerunning a job reproduces its sampled outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the seed space


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token; temperature 0 means greedy."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # keep the smallest set whose probability reaches p
    seed: int = 0  # per-item seed; with the position it fixes the random draw

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_json(self) -> dict:
        """Only what differs from greedy travels, keeping decode headers small."""
        if self.greedy:
            return {}
        return {"t": self.temperature, "k": self.top_k, "p": self.top_p, "s": self.seed}

    @classmethod
    def from_json(cls, value: dict) -> "SamplingParams":
        if not value:
            return cls()
        return cls(temperature=float(value["t"]), top_k=int(value["k"]), top_p=float(value["p"]),
                   seed=int(value["s"]))


def choose_token(logits: torch.Tensor, params: SamplingParams, position: int,
                 log_probs: torch.Tensor | None = None) -> tuple[int, float]:
    """Pick the token for `position` from float32 logits [vocab]; returns (token, its log-prob).
    `log_probs` may be passed when the caller computed them for a whole batch at once."""
    if log_probs is None:
        log_probs = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, float(log_probs[token])
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    generator = torch.Generator().manual_seed((params.seed * _SEED_MIX + position) % (1 << 63))
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(log_probs[token])


def target_log_probs(logits: torch.Tensor, targets: list[int]) -> list[float]:
    """Log-probabilities of given next tokens, one per position: logits [T, vocab], targets [T]."""
    log_probs = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(targets, dtype=torch.long).unsqueeze(1)
    return log_probs.gather(1, index).squeeze(1).tolist()
