"""The schedule's budgets: slots, micro-batches, tokens per step, context; what the planner sizes and the
broker's scheduler keeps to."""

from __future__ import annotations

from dataclasses import dataclass, replace

from layerbus.planner.prefix_budget import PrefixCacheConfig
from layerbus.planner.speculation import SpeculationConfig


@dataclass(frozen=True)
class BatchingConfig:
    """Budgets for the schedule."""

    num_slots: int = 0  # sequences in flight at once, over all micro-batches (0 = micro_batch_size x micro-batches)
    num_micro_batches: int = 0  # 0 = chosen: planned (planner.batch_sizing.choose_by_plan), else default_micro_batches
    micro_batch_size: int = 32  # sequences per micro-batch when num_slots is 0: decode reads every weight
    # once per micro-batch step, so on a CPU tokens/s grows with this until compute-bound. 0 = chosen by
    # the broker from the stages' profiles and the job (planner.batch_sizing; 32 where it cannot choose)
    # Tokens one micro-batch step may carry (decode rows + prefill chunks); 0 = chosen. Prompts are cut into chunks
    # at its multiples (broker.scheduler.prefill_chunk_end); a chunk that does not fit waits, unless it is the
    # step's first, which then runs over rather than starve.
    max_step_tokens: int = 256
    max_context: int = 2048  # prompt + generated tokens per sequence (capped by the model's own limit)
    max_step_failures: int = 3  # a sequence whose step fails this many times alone fails with the stage's error
    # Shared prompt prefixes kept on every stage and copied instead of computed (broker/prefix_cache.py).
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    # Every stage but the last keeps what it sent on (one hidden state per slot-position), so that after a
    # re-plan only the layers nobody kept are recomputed (broker.replay_window); False (--no-keep-caches):
    # no memory for it, and a re-plan recomputes every layer of every active sequence.
    keep_caches: bool = True
    # Draft tokens on decode rows, verified by the last stage (broker/speculation.py); off: one token per trip.
    speculation: SpeculationConfig = SpeculationConfig()

    def __post_init__(self) -> None:
        if self.num_slots < 0 or self.micro_batch_size < 0 or self.num_micro_batches < 0:
            raise ValueError(f"need num_slots >= 0, micro_batch_size >= 0 (0 = chosen) and num_micro_batches >= 0, got "
                             f"{self.num_slots=}, {self.micro_batch_size=}, {self.num_micro_batches=}")
        if self.max_step_tokens < 0:
            raise ValueError(f"max_step_tokens must be >= 0 (0 = chosen), got {self.max_step_tokens}")
        if self.max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {self.max_step_failures}")
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")

    def resolved(self, num_stages: int) -> "BatchingConfig":
        """The same budgets with num_micro_batches and num_slots filled in for a chain of stages (sizes
        still left to choose take the defaults: 32 rows, 256 tokens per step)."""
        micro_batches = self.num_micro_batches or default_micro_batches(num_stages)
        slots = self.num_slots or (self.micro_batch_size or 32) * micro_batches
        micro_batches = max(1, min(micro_batches, slots))
        return replace(self, num_slots=slots, num_micro_batches=micro_batches,
                       micro_batch_size=-(-slots // micro_batches), max_step_tokens=self.max_step_tokens or 256)

    @property
    def chosen_by_broker(self) -> bool:
        """Some size is left for the broker to choose (0 = auto). The number of micro-batches counts too:
        left at 0 beside a pinned size and prefill budget, it used to fall back to one per stage plus one
        instead of being planned (bench_chains ran one chain of four at 5 x 8 slots that way: 96 items in
        waves of 40, 40 and 16)."""
        return not (self.num_slots or self.micro_batch_size) or not self.max_step_tokens or not self.num_micro_batches


def default_micro_batches(num_stages: int) -> int:
    """One micro-batch per stage plus one, so every stage has one while the broker plans the next;
    a single stage gets one: the broker's few milliseconds between its steps cost less than halving
    the rows of every step would (dense work measured 194 against 115 tok/s on the default model)."""
    return num_stages + 1 if num_stages > 1 else 1
