"""How `layerbus run --stages N --chains K` deals its N local stages into K chains: a pure decision.

Each chain is a half-open range `[first, first + count)` of the stage indices, so stage i overall keeps
its name (stage-i), its log (stage-i.log) and its i-th --memory-budget whichever chain it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ChainStages:
    """One chain's share of the local stages."""

    index: int  # 0-based; events and logs call it "chain index + 1"
    first: int  # the first stage's overall index (stage-first)
    count: int  # stages in this chain, >= 1

    @property
    def label(self) -> str:
        return f"chain {self.index + 1}"

    @property
    def stages(self) -> range:
        """The overall indices of this chain's stages."""
        return range(self.first, self.first + self.count)


def chains_error(stages: int, chains: int) -> str | None:
    """Why `--stages stages --chains chains` cannot be dealt, with the way out; None when it can."""
    if chains < 1:
        return (f"--chains {chains}: a run needs at least one chain; use --chains 1 (one pipeline over all "
                f"{stages} stages, the default) up to --chains {stages}")
    if chains > stages:
        return (f"--chains {chains} with --stages {stages}: every chain needs at least one stage; use --chains "
                f"{stages} or fewer, or --stages {chains} or more")
    return None


def split_stages(stages: int, chains: int) -> list[ChainStages]:
    """`stages` dealt into `chains` consecutive groups, N // K each and one more for the first N % K."""
    error = chains_error(stages, chains)
    if error is not None:
        raise ValueError(error)
    base, extra = divmod(stages, chains)
    out, first = [], 0
    for index in range(chains):
        count = base + (1 if index < extra else 0)
        out.append(ChainStages(index, first, count))
        first += count
    return out


def split_sizes(sizes: Sequence[int]) -> list[ChainStages]:
    """Consecutive chains of these sizes, in order (the planner's grouping of alike stages)."""
    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"every chain needs at least one stage, got sizes {list(sizes)}")
    out, first = [], 0
    for index, count in enumerate(sizes):
        out.append(ChainStages(index, first, count))
        first += count
    return out
