"""Batch sizes chosen from the stages' profiles, their memory and the job (pure, table-tested)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from layerbus.planner.batch_sizing import choose_batching, choose_by_plan, max_slots, micro_batch_counts, rows_to_amortize
from layerbus.planner.placement import ModelMemory, StageProfile
from layerbus.planner.prefix_budget import PrefixCacheConfig
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.step_cost import LinearCost

AUTO = BatchingConfig(micro_batch_size=0, max_step_tokens=0, max_context=1000)
MEMORY = ModelMemory(layer_weight_bytes=(100,) * 10, embed_bytes=100, head_bytes=100, head_shares_embed=False,
                     kv_bytes_per_token=1, activation_bytes_per_token=8, hidden_size=2, intermediate_size=4,
                     num_attention_heads=1, vocab_size=8, dtype_bytes=4)


def fitted(name: str, per_pass: float, per_row: float, per_token: float = 1e-4, budget: int = 10**9,
           kv: float = 0.0) -> StageProfile:
    """A stage whose layer costs `per_pass` per step (reading its weights) and `per_row` per decode row."""
    return StageProfile(name, layer_decode_s=1.0, layer_prefill_s=1.0, embed_s=0.0, head_s=0.0, memory_budget=budget,
                        layer_cost=LinearCost(per_pass_s=per_pass, per_row_s=per_row, per_row_kv_s=kv,
                                              per_token_s=per_token),
                        overhead_cost=LinearCost())


@pytest.mark.parametrize("per_pass, per_row, want", [
    (1.0, 1.0, 7),  # fixed = 1 row: 7 rows bring it within 15% (1/7 = 14%)
    (0.0, 1.0, 1),  # nothing fixed: one row is as cheap per row as many
    (3.0, 0.1, 200),  # weight reads dominate (a GPU): many rows
])
def test_rows_to_amortize_the_fixed_part(per_pass, per_row, want) -> None:
    assert rows_to_amortize(fitted("a", per_pass, per_row), 10, 0.0, 0.15) == want


def test_the_kv_cost_counts_per_row() -> None:
    # Longer contexts cost more per row, so fewer rows amortize the same fixed part.
    short = rows_to_amortize(fitted("a", 1.0, 0.5, kv=0.01), 10, 0.0, 0.15)
    long = rows_to_amortize(fitted("a", 1.0, 0.5, kv=0.01), 10, 100.0, 0.15)
    assert long < short


@pytest.mark.parametrize("requested, items, profiles, want_size, want_slots, reason", [
    # Chosen from the profiles: the stage needing the most rows decides.
    (AUTO, None, [fitted("a", 1.0, 1.0), fitted("b", 2.0, 1.0)], 14, 14 * 3, "(b1 needs the most rows"),
    # No more slots than items: 10 items over 3 micro-batches.
    (AUTO, 10, [fitted("a", 1.0, 1.0), fitted("b", 2.0, 1.0)], 4, 12, "10 items spread over the 3 micro-batches"),
    # A job a little larger than the amortizing size gets a slot per item, not a tail of a second wave.
    (AUTO, 64, [fitted("a", 1.0, 1.0), fitted("b", 2.0, 1.0)], 22, 66, "a slot for each of the job's 64 items"),
    # A large job: the most per micro-batch (then memory decides, below).
    (AUTO, 10**6, [fitted("a", 1.0, 1.0, budget=10**12), fitted("b", 2.0, 1.0, budget=10**12)], 256, 768,
     "the most per micro-batch"),
    # Without profiles the default size grows the same way.
    (AUTO, 200, [StageProfile("a", 1.0, 1.0, 0.0, 0.0, 10**9)] * 2, 67, 201, "a slot for each of the job's 200"),
    # The user's values win.
    (BatchingConfig(micro_batch_size=5, max_step_tokens=0), None, [fitted("a", 2.0, 1.0)] * 2, 5, 15, "as given"),
    (BatchingConfig(num_slots=8, micro_batch_size=0, max_step_tokens=0), 100, [fitted("a", 2.0, 1.0)] * 2, 3, 8,
     "slots 8: as given"),
    # Profiles that cannot tell fixed from per-row costs (a cluster file's speed): the default.
    (AUTO, None, [StageProfile("a", 1.0, 1.0, 0.0, 0.0, 10**9)] * 2, 32, 96, "the default"),
])
def test_choose_batching(requested, items, profiles, want_size, want_slots, reason) -> None:
    profiles = [StageProfile(**{**vars(p), "name": f"{p.name}{i}"}) for i, p in enumerate(profiles)]
    sizing = choose_batching(requested, 2, profiles, MEMORY, items)
    assert sizing.batching.micro_batch_size == want_size
    assert sizing.batching.num_slots == want_slots
    assert sizing.batching.num_micro_batches == 3
    assert any(reason in line for line in sizing.reasons), sizing.reasons


def test_memory_caps_the_slots() -> None:
    # 2 stages of 2,000 bytes: 1,900 each after the reserve, 1,200 of weights, the workspaces; KV is
    # 10 layers x 1 byte x 1000 tokens = 10,000 bytes per slot: not even one slot fits, so one it is.
    small = [fitted("a", 5.0, 0.1, budget=2000), fitted("b", 5.0, 0.1, budget=2000)]
    assert max_slots(small, MEMORY, 1000, 64, 0.05) == 1
    sizing = choose_batching(AUTO, 2, small, MEMORY)
    assert sizing.batching.micro_batch_size == 1 and "capped at 1 by memory" in " ".join(sizing.reasons)
    roomy = [fitted("a", 5.0, 0.1, budget=10**6), fitted("b", 5.0, 0.1, budget=10**6)]
    # (2 x 950,000 - 1,200 of weights - 100 for the layer the split at whole layers may waste - the
    # workspaces) // (1,000 tokens x (11 layers of 1 byte, one for that split, + 8 bytes of the hidden state
    # the first stage keeps of what it sends) + 96 for each row's logits on the last stage: 3 x 8 x 4 bytes)
    assert max_slots(roomy, MEMORY, 1000, 64, 0.05) == 72
    assert max_slots(roomy, MEMORY, 1000, 64, 0.05, keep_sent=False) == 124  # (--no-keep-caches) 11 bytes a position
    # A job of a million items wants 256 per micro-batch; memory caps it at 90 slots // 3 micro-batches
    # (workspaces for the default 256 tokens per step, the prefill budget being auto too).
    larger = [fitted("a", 5.0, 0.1, budget=2_002_000), fitted("b", 5.0, 0.1, budget=2_002_000)]
    assert max_slots(larger, MEMORY, 1000, 256, 0.05) == 89
    assert max_slots(larger, MEMORY, 1000, 256, 0.05, micro_batches=3) == 90  # 3 micro-batches share the logits
    no_prefixes = replace(AUTO, prefix_cache=PrefixCacheConfig(budget_tokens=0))
    big_job = choose_batching(no_prefixes, 2, larger, MEMORY, items=10**6)
    assert big_job.batching.micro_batch_size == 30 and "capped at 30 by memory" in " ".join(big_job.reasons)
    # The prefix cache's positions come out of the same memory: 19 bytes x 10,000 tokens = 10 slots.
    assert max_slots(larger, MEMORY, 1000, 256, 0.05, prefix_cache_tokens=10_000) == 79
    with_prefixes = replace(AUTO, prefix_cache=PrefixCacheConfig(budget_tokens=10_000))
    assert choose_batching(with_prefixes, 2, larger, MEMORY, items=10**6).batching.micro_batch_size == 26


def test_the_prefill_budget_amortizes_the_fixed_part_per_token() -> None:
    # per pass 1.0, per token 0.01: 1 / (0.15 x 0.01) = 667 tokens -> 704 (in 64s), plus the decode rows.
    sizing = choose_batching(BatchingConfig(micro_batch_size=8, max_step_tokens=0, max_context=4096), 2,
                             [fitted("a", 1.0, 1.0, per_token=0.01)] * 1, MEMORY)
    assert sizing.batching.max_step_tokens == 8 + 704
    given = choose_batching(BatchingConfig(micro_batch_size=8, max_step_tokens=100), 2, [fitted("a", 1.0, 1.0)], MEMORY)
    assert given.batching.max_step_tokens == 100


@pytest.mark.parametrize("requested_count, stages, want", [
    (0, 1, (1,)),  # a single stage: one micro-batch
    (0, 2, (2, 3)),  # a chain: one per stage, or one more to hide the broker's turnaround
    (0, 3, (3, 4)),
    (5, 3, (5,)),  # the user's
])
def test_micro_batch_counts(requested_count, stages, want) -> None:
    assert micro_batch_counts(requested_count, stages) == want


@pytest.mark.parametrize("fastest", [2, 3])
def test_the_count_whose_plan_predicts_more_wins(fastest) -> None:
    planned = []

    def plan_for(batching):
        planned.append((batching.num_micro_batches, batching.micro_batch_size))
        speed = 100.0 if batching.num_micro_batches == fastest else 80.0
        return SimpleNamespace(chosen=SimpleNamespace(tokens_per_s=speed))

    profiles = [fitted("a", 1.0, 1.0), fitted("b", 2.0, 1.0)]
    sizing, plan = choose_by_plan(AUTO, 2, profiles, MEMORY, plan_for, items=60)
    assert planned == [(2, 30), (3, 20)], "each count is sized for the job (60 items) and planned"
    assert sizing.batching.num_micro_batches == fastest and plan.chosen.tokens_per_s == 100.0
    assert sizing.reasons[0].startswith(f"micro-batches {fastest} of ") and "the fastest predicted" in sizing.reasons[0]


def test_a_large_job_is_sized_to_what_the_planner_then_accepts() -> None:
    """The default model's shapes, two stages of 20.17 GiB (this machine's, as the bench that found it saw
    them), a 500-item job at a 4,096-token context: every slot's KV and every row's logits, at the prefill
    budget chosen, fit what the placement checks (it was 90 MiB short, counting one row's logits)."""
    from layerbus.planner.placement import plan_placement

    memory = ModelMemory(layer_weight_bytes=(14_155_776,) * 30, embed_bytes=113_246_208, head_bytes=113_246_208,
                         head_shares_embed=True, kv_bytes_per_token=1536, activation_bytes_per_token=2304,
                         hidden_size=576, intermediate_size=1536, num_attention_heads=9, vocab_size=49152,
                         dtype_bytes=4)
    stages = [fitted(name, 0.02, 0.0005, budget=int(20.17 * 2**30), per_token=0.0004) for name in ("a", "b")]
    sizing = choose_batching(BatchingConfig(micro_batch_size=0, max_step_tokens=0, max_context=4096), 2, stages,
                             memory, items=500)
    assert sizing.batching.num_slots > 64, sizing.reasons
    plan_placement(stages, memory, sizing.batching)  # raises PlacementError when the sizes do not fit


@pytest.mark.parametrize("batching, chosen", [
    (BatchingConfig(micro_batch_size=0, max_step_tokens=0), True),  # `layerbus run`'s defaults: all chosen
    (BatchingConfig(micro_batch_size=8, max_step_tokens=256), True),  # the count still left: planned
    (BatchingConfig(micro_batch_size=8, max_step_tokens=256, num_micro_batches=4), False),  # all pinned
    (BatchingConfig(num_slots=64, max_step_tokens=512, num_micro_batches=2), False),
    (BatchingConfig(micro_batch_size=8, max_step_tokens=0, num_micro_batches=4), True),  # the prefill budget
])
def test_the_broker_chooses_whatever_size_is_left_at_0_the_micro_batch_count_too(batching, chosen) -> None:
    assert batching.chosen_by_broker is chosen
