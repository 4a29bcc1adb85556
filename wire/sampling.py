"""Sampling parameters as both sides speak them: the broker sets them per item, each step row
carries their compact JSON form, and the last stage (stages/sampling.py) draws the token with them."""

from __future__ import annotations

from dataclasses import dataclass

# The step row's sampling key asking the last stage for the k most likely tokens beside the chosen one
# (OpenAI's top_logprobs); absent or 0: none, and the result's token entry keeps its three fields.
TOP_LOGPROBS_KEY = "l"
# OpenAI's own limit on top_logprobs.
MAX_TOP_LOGPROBS = 20


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
        if "t" not in value:  # greedy; the row may still carry a token mask (wire/constraint.py)
            return cls()
        return cls(temperature=float(value["t"]), top_k=int(value["k"]), top_p=float(value["p"]),
                   seed=int(value["s"]))


# Speculative decoding (broker/speculation.py). A decode row of length k + 1 carries its k draft tokens under this
# sampling key: its positions are the fed token, then the drafts. The last stage picks the token after each
# position and accepts drafts while each equals its pick; the result's `accepted` field gives, per such row,
# [slot, [[token, logprob(, top)], ...]] for the accepted drafts, and its `tokens` entry is the pick after them.
DRAFT_KEY = "d"
# With a token mask (wire/constraint.py's MASK_KEY, for the first position): the packed mask of each later
# position, as if the drafts before it were taken.
DRAFT_MASKS_KEY = "dm"


def row_drafts(sampling: dict, length: int) -> list[int]:
    """A row's draft tokens (none when it carries none); ValueError when they do not fill the row's length - 1
    positions after the first, or a draft mask list does not match them."""
    drafts = sampling.get(DRAFT_KEY)
    if drafts is None:
        return []
    if (not isinstance(drafts, list) or len(drafts) != length - 1
            or not all(type(t) is int and t >= 0 for t in drafts)):
        raise ValueError(f"a row of {length} positions carries {length - 1} draft token ids, got {drafts!r:.80}")
    masks = sampling.get(DRAFT_MASKS_KEY)
    if masks is not None and (not isinstance(masks, list) or len(masks) != len(drafts)
                              or not all(isinstance(m, str) for m in masks)):
        raise ValueError(f"draft masks must be one packed mask per draft ({len(drafts)}), got {masks!r:.80}")
    return drafts
