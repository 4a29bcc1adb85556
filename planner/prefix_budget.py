"""The prefix cache's size and block naming, as the planner counts its memory and the broker's bookkeeping
(broker/prefix_cache.py) uses them: how many positions every stage keeps for shared prompt prefixes, and
the chained block hashes that name a prefix."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheConfig:
    """The stages' prefix cache: its size in token positions (each stage keeps that many positions of
    its own layers' keys and values) and its block size."""

    budget_tokens: int = 4096  # 0 turns the cache off (--no-prefix-cache)
    block_tokens: int = 16
    # Admission looks this far down the queue for an item sharing a prefix with what the stages hold or
    # recently saw, so items of one prefix go in close together (1: first come, first admitted).
    admit_lookahead: int = 32

    def __post_init__(self) -> None:
        if self.admit_lookahead < 1:
            raise ValueError(f"admission lookahead must be >= 1 (1 = first come, first admitted), got {self.admit_lookahead}")
        if self.budget_tokens < 0:
            raise ValueError(f"prefix cache budget must be >= 0 tokens (0 = off), got {self.budget_tokens}")
        if self.block_tokens < 1:
            raise ValueError(f"prefix cache blocks must hold >= 1 token, got {self.block_tokens}")

    @property
    def enabled(self) -> bool:
        return self.budget_tokens >= self.block_tokens


# The cache never holds more positions than this share of the slots' own (slots x context): where memory
# is tight the slots were sized to fit it, and a fixed 4096 positions (180 MiB on the default model) would
# crowd them out; a quarter adds at most a quarter to the KV memory.
MAX_SHARE_OF_SLOTS = 0.25


def prefix_positions(config: PrefixCacheConfig, num_slots: int, max_context: int) -> int:
    """The positions every stage keeps for prefixes: the configured budget, at most MAX_SHARE_OF_SLOTS of
    the slots' positions (0: off, or too small for one block)."""
    if not config.enabled:
        return 0
    positions = min(config.budget_tokens, int(num_slots * max_context * MAX_SHARE_OF_SLOTS))
    return positions if positions >= config.block_tokens else 0


def block_hashes(tokens: list[int], block_tokens: int) -> list[bytes]:
    """The chained hash of each full block of `tokens`: entry k covers tokens[:(k + 1) * block_tokens]."""
    hashes: list[bytes] = []
    previous = b""
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("q", tokens[end - block_tokens:end]).tobytes())
        previous = digest.digest()
        hashes.append(previous)
    return hashes
