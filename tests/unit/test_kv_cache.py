"""The slot KV cache and the step runner, against transformers itself: whatever mix of prefill
chunks, decode rows, slots and rewinds a step carries, each row's logits must equal those of the
model's own forward pass over that sequence alone."""

from __future__ import annotations


import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from layerbus.models.model_files import open_model_dir
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import CacheGroup, KVArena
from layerbus.stages.shard import ShardSpec, StageShard, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from tests.helpers.tiny_llama import ATOL, TINY, save_tiny_model, tokens


class Harness:
    """A one-stage chain (embedding, all layers, head) with its arena, plus the reference model."""

    def __init__(self, model, shard: StageShard, num_slots: int = 8, max_context: int = 512):
        self.model, self.shard = model, shard
        config = shard.config
        self.arena = KVArena(list(shard.spec.layers), num_slots, config.num_key_value_heads, config.head_dim,
                             torch.float32, torch.device("cpu"), max_context)
        self._reference: dict[tuple[int, ...], torch.Tensor] = {}

    def step(self, rows: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
        """Run (slot, start, tokens) rows as one step; returns each row's logits [length, vocab]."""
        step_rows = [StepRow(slot, start, len(tokens), emit=True) for slot, start, tokens in rows]
        inputs = torch.tensor([t for _, _, tokens in rows for t in tokens], dtype=torch.int64)
        logits = head_logits(self.shard, run_step(self.shard, self.arena, step_rows, inputs))
        return list(torch.split(logits, [len(tokens) for _, _, tokens in rows]))

    def reference(self, sequence: list[int]) -> torch.Tensor:
        key = tuple(sequence)
        if key not in self._reference:
            with torch.no_grad():
                self._reference[key] = self.model(torch.tensor([sequence])).logits[0].float()
        return self._reference[key]

    def check(self, sequences: dict[int, list[int]], rows: list[tuple[int, int, int]]) -> None:
        """Run rows given as (slot, start, length) over each slot's full sequence; compare."""
        full_rows = [(slot, start, sequences[slot][start:start + length]) for slot, start, length in rows]
        for (slot, start, length), got in zip(rows, self.step(full_rows)):
            want = self.reference(sequences[slot])[start:start + length]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"slot {slot} @ {start}: {m}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = save_tiny_model(LlamaConfig(**TINY), path)
    return model, load_shard(open_model_dir(path), ShardSpec(LayerRange(0, 2), True, True))


@pytest.fixture
def harness(llama) -> Harness:
    return Harness(*llama)


def test_reference_is_sensitive_to_the_prefix(harness: Harness) -> None:
    # The comparisons below would prove nothing if a wrong prefix gave the same logits.
    seq = tokens(1, 12)
    changed = [seq[0] + 1] + seq[1:]
    assert (harness.reference(seq)[-1] - harness.reference(changed)[-1]).abs().max() > 100 * ATOL


def test_one_prompt_alone_matches_transformers(harness: Harness) -> None:
    seq = tokens(2, 10)
    harness.check({0: seq}, [(0, 0, 10)])


def test_prefill_in_three_chunks_mixed_with_other_rows(harness: Harness) -> None:
    seqs = {1: tokens(3, 12), 2: tokens(4, 9), 3: tokens(5, 7)}
    # step 1: slot 1's first chunk beside slot 2's whole prompt
    harness.check(seqs, [(1, 0, 5), (2, 0, 6)])
    # step 2: slot 1's second chunk, slot 2 decodes, slot 3 starts
    harness.check(seqs, [(2, 6, 1), (1, 5, 4), (3, 0, 5)])
    # step 3: slot 1's last chunk, slots 2 and 3 decode
    harness.check(seqs, [(1, 9, 3), (3, 5, 1), (2, 7, 1)])
    assert harness.arena.lengths[1:4] == [12, 8, 6]


def test_decode_rows_of_different_lengths_batch_together(harness: Harness) -> None:
    seqs = {0: tokens(6, 5), 1: tokens(7, 13), 2: tokens(8, 30)}
    for slot, seq in seqs.items():
        harness.check(seqs, [(slot, 0, len(seq) - 3)])
    for offset in (3, 2, 1):
        harness.check(seqs, [(slot, len(seq) - offset, 1) for slot, seq in seqs.items()])


def test_non_adjacent_slots_in_any_row_order(harness: Harness) -> None:
    seqs = {5: tokens(9, 8), 0: tokens(10, 11), 3: tokens(11, 4)}
    harness.check(seqs, [(5, 0, 6), (0, 0, 9), (3, 0, 2)])
    harness.check(seqs, [(5, 6, 1), (0, 9, 1), (3, 2, 1)])  # slots 5, 0, 3: not sorted, not contiguous
    harness.check(seqs, [(3, 3, 1), (5, 7, 1), (0, 10, 1)])


def test_slot_reuse_after_release_starts_again_at_zero(harness: Harness) -> None:
    first, second, neighbour = tokens(12, 20), tokens(13, 6), tokens(14, 9)
    harness.check({2: first, 3: neighbour}, [(2, 0, 20), (3, 0, 8)])
    harness.arena.release(2)
    assert harness.arena.lengths[2] == 0
    seqs = {2: second, 3: neighbour}
    harness.check(seqs, [(2, 0, 5), (3, 8, 1)])
    harness.check(seqs, [(2, 5, 1)])


def test_rewind_without_release_masks_the_stale_tail(harness: Harness) -> None:
    old, new = tokens(15, 16), tokens(16, 6)
    harness.check({4: old}, [(4, 0, 16)])
    harness.check({4: old[:6] + new}, [(4, 6, 6)])  # recovery: re-run from position 6
    harness.check({4: new}, [(4, 0, 4)])  # a new sequence at 0, 12 stale positions behind it
    harness.check({4: new}, [(4, 4, 1)])
    harness.check({4: new}, [(4, 5, 1)])


def test_capacity_grows_past_128_and_shrinks_after_release(harness: Harness) -> None:
    arena = harness.arena
    assert arena.capacity == 128
    small_bytes = arena.bytes_used()
    assert small_bytes == 2 * 2 * (8 * 2 * 128 * 16) * 4  # layers x (k, v) x [slots, kv_heads, cap, head_dim] fp32
    long, short = tokens(17, 201), tokens(18, 12)
    seqs = {0: long, 6: short}
    harness.check(seqs, [(6, 0, 10)])
    harness.check(seqs, [(0, 0, 100)])
    harness.check(seqs, [(0, 100, 100), (6, 10, 1)])  # needs 200 positions: 128 -> 256
    assert arena.capacity == 256 and arena.bytes_used() == 2 * small_bytes
    harness.check(seqs, [(0, 200, 1), (6, 11, 1)])  # the short slot's keys survived the copy
    arena.release(0)
    assert arena.capacity == 128 and arena.bytes_used() == small_bytes
    harness.check({6: short + [7]}, [(6, 12, 1)])  # and survived the shrink


def test_growth_is_capped_at_max_context(llama) -> None:
    harness = Harness(*llama, num_slots=2, max_context=200)
    seq = tokens(19, 200)
    harness.check({0: seq}, [(0, 0, 130)])
    assert harness.arena.capacity == 200
    harness.check({0: seq}, [(0, 130, 70)])
    with pytest.raises(ValueError, match=r"position 201 exceeds the context budget of 200 tokens"):
        harness.step([(0, 200, [1])])


def test_small_context_starts_small(llama) -> None:
    harness = Harness(*llama, num_slots=2, max_context=40)
    assert harness.arena.capacity == 40
    harness.check({1: tokens(20, 40)}, [(1, 0, 40)])


def test_step_beyond_the_cached_length_is_refused(harness: Harness) -> None:
    harness.check({0: tokens(21, 5)}, [(0, 0, 5)])
    with pytest.raises(ValueError, match=r"slot 0: step starts at position 7 but only 5 tokens are cached"):
        harness.step([(0, 7, [1])])
    with pytest.raises(ValueError, match=r"slot 1: step starts at position 1 but only 0 tokens are cached"):
        harness.step([(1, 1, [1, 2])])
    with pytest.raises(ValueError, match=r"slot 8 is outside this stage's 8 slots"):
        harness.step([(8, 0, [1])])


def test_step_inputs_must_match_the_rows(harness: Harness) -> None:
    with pytest.raises(ValueError, match=r"step carries 3 positions but its rows add up to 2"):
        run_step(harness.shard, harness.arena, [StepRow(0, 0, 2)], torch.tensor([1, 2, 3]))


def test_release_only_step_returns_no_rows(harness: Harness) -> None:
    out = run_step(harness.shard, harness.arena, [], torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, 64)


def test_arena_bookkeeping_without_a_model() -> None:
    arena = KVArena([3, 4], num_slots=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"), max_context=1000, initial_capacity=4)
    group = CacheGroup([1], [0], 9)
    arena.prepare(group)
    assert arena.capacity == 16 and arena.lengths == [0, 0]
    arena.commit(group)
    assert arena.lengths == [0, 9]
    arena.keys[0][1, 0, :9] = torch.arange(9.0).unsqueeze(1)
    arena.release(1)  # nothing left: back to the initial capacity
    assert arena.capacity == 4 and arena.lengths == [0, 0]
    arena.prepare(CacheGroup([0], [0], 40))
    arena.commit(CacheGroup([0], [0], 40))
    assert arena.capacity == 64
    arena.prepare(CacheGroup([1], [0], 3))
    arena.commit(CacheGroup([1], [0], 3))
    arena.release(1)  # the 40-token sequence still needs its room
    assert arena.capacity == 64


# -- sliding window -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    model = save_tiny_model(MistralConfig(**TINY, sliding_window=4), path, seed=1)
    return model, load_shard(open_model_dir(path), ShardSpec(LayerRange(0, 2), True, True))


def test_sliding_window_matches_transformers(mistral) -> None:
    harness = Harness(*mistral)
    assert harness.shard.layer_windows == [4, 4]
    seqs = {0: tokens(22, 14), 1: tokens(23, 9), 3: tokens(24, 6)}
    harness.check(seqs, [(0, 0, 6), (1, 0, 3)])
    harness.check(seqs, [(0, 6, 5), (1, 3, 4), (3, 0, 5)])  # chunks longer than the window
    harness.check(seqs, [(0, 11, 1), (1, 7, 1), (3, 5, 1)])  # decode rows at different positions
    harness.check(seqs, [(0, 12, 1), (1, 8, 1)])
    harness.check(seqs, [(0, 13, 1)])


def test_sliding_window_changes_the_answer(mistral) -> None:
    # Without this, the comparison above could pass with the window ignored on both sides.
    harness = Harness(*mistral)
    seq = tokens(22, 14)
    harness.shard.layer_windows = [None, None]
    try:
        full_attention = harness.step([(0, 0, seq)])[0]
    finally:
        harness.shard.layer_windows = [4, 4]
    difference = (full_attention - harness.reference(seq)).abs().amax(dim=-1)
    assert difference[:4].max() < ATOL  # within the window both agree
    assert difference[4:].min() > 100 * ATOL
