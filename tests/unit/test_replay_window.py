"""Which layers a re-plan recomputes (broker.replay_window), and the scheduler's replay of them."""

from __future__ import annotations

import pytest

from layerbus.broker.replay_window import StageCaches, replay_window
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig
from layerbus.broker.scheduler import Scheduler
from layerbus.wire.spans import LayerRange

R = LayerRange

CASES = {
    # three stages [0,2) [2,4) [4,6); one is lost, the survivors re-planned over six layers
    "middle lost: from stage 0's kept outputs to the end of the lost span": (
        [StageCaches(R(0, 3), R(0, 2), 2), StageCaches(R(3, 6), R(4, 6), None)], R(2, 4)),
    "first lost: from the tokens, through the layer the new split moved": (
        [StageCaches(R(0, 3), R(2, 3), 4), StageCaches(R(3, 6), R(4, 6), None)], R(0, 4)),
    "last lost: from stage 0's kept outputs to the end": (
        [StageCaches(R(0, 3), R(0, 2), 2), StageCaches(R(3, 6), R(3, 4), 4)], R(2, 6)),
    "the window starts at a boundary: the stage before sends what it kept": (
        [StageCaches(R(0, 2), R(0, 2), 2), StageCaches(R(2, 6), R(4, 6), None)], R(2, 4)),
    # a rebalance [0,3) [3,6) -> [0,2) [2,6): layer 2 moved, and nobody kept what enters it
    "kept outputs enter another layer: back to the tokens": (
        [StageCaches(R(0, 2), R(0, 2), 3), StageCaches(R(2, 6), R(3, 6), None)], R(0, 3)),
    "every layer kept: nothing to replay": (
        [StageCaches(R(0, 3), R(0, 3), 3), StageCaches(R(3, 6), R(3, 6), None)], None),
    "nothing kept (restarted stages): every layer": (
        [StageCaches(R(0, 3)), StageCaches(R(3, 6))], R(0, 6)),
    "a kept span reported past the stage's own is trimmed to it": (
        [StageCaches(R(0, 2), R(0, 4), 2), StageCaches(R(2, 6), None, None)], R(2, 6)),
    "outputs reported by a stage that does not hold the layer before do not count": (
        [StageCaches(R(0, 3), R(0, 3), 5), StageCaches(R(3, 6), R(5, 6), None)], R(0, 5)),
}


@pytest.mark.parametrize("chain, expected", CASES.values(), ids=list(CASES))
def test_replay_window(chain, expected):
    assert replay_window(6, chain) == expected


def brute_force_window(num_layers: int, chain: list[StageCaches]) -> LayerRange | None:
    """The definition, spelled out: the smallest [w0, w1) covering every layer nobody kept, where w0 is 0
    or a layer whose input the stage holding it (or sending it) kept."""
    kept = {layer for s in chain if s.kept for layer in range(s.kept.start, s.kept.end) if layer in range(s.span.start, s.span.end)}
    moved = [layer for layer in range(num_layers) if layer not in kept]
    if not moved:
        return None
    starts = [0] + [b for b in range(1, moved[0] + 1)
                    if any(s.span.start < b <= s.span.end and s.outputs_at == b for s in chain)]
    return LayerRange(max(starts), moved[-1] + 1)


def test_replay_window_matches_its_definition_on_every_small_case():
    import itertools

    spans = [R(0, 2), R(2, 5), R(5, 6)]
    options = [None, R(0, 1), R(0, 2), R(2, 3), R(2, 5), R(3, 5), R(5, 6)]
    outputs = [None, 1, 2, 3, 5]
    for kept in itertools.product(options, repeat=3):
        for outs in itertools.product(outputs, repeat=2):
            chain = [StageCaches(span, k, o) for span, k, o in zip(spans, kept, [*outs, None])]
            assert replay_window(6, chain) == brute_force_window(6, chain), chain


def scheduler(slots: int = 4, micro_batches: int = 2) -> Scheduler:
    return Scheduler(BatchingConfig(num_slots=slots, num_micro_batches=micro_batches, max_step_tokens=8), 2, {99})


def test_a_replay_covers_each_cached_position_once_over_the_window_then_decoding_goes_on():
    s = scheduler()
    s.submit(GenerationRequest("a", [1, 2, 3, 4, 5], max_new_tokens=8), 0.0)
    s.submit(GenerationRequest("b", [6, 7, 8], max_new_tokens=8), 0.0)
    s.submit(GenerationRequest("c", list(range(10, 22)), max_new_tokens=8), 0.0)  # 12 tokens: prefill in 2 steps
    first = s.plan_step(0, 0.0)
    s.apply_result(first, {row.slot: (50 + row.slot, -0.1) for row in first.rows if row.emit}, 0.0)
    assert [s.active[r.slot].cached for r in first.rows] == [5, 3]
    decode = s.plan_step(0, 0.0)  # both decode once: 6 and 4 cached
    s.apply_result(decode, {row.slot: (60, -0.1) for row in decode.rows}, 0.0)
    half = s.plan_step(1, 0.0)  # c: its first 8 prompt tokens only
    s.apply_result(half, {}, 0.0)
    cached = {slot: seq.cached for slot, seq in s.active.items()}
    assert sorted(cached.values()) == [4, 6, 8]
    assert s.can_replay_layers()

    assert s.replay_layers((2, 4)) == 18
    assert not s.can_replay_layers()  # a second re-plan now would find caches half rebuilt
    seen: dict[int, list[int]] = {slot: [] for slot in cached}
    steps = 0
    while not s.can_replay_layers():
        steps += 1
        assert steps < 20, "the replay never ends"
        for mb in (0, 1):
            plan = s.plan_step(mb, 0.0)
            if plan is None:
                continue
            if plan.window is None:  # the turn of the sequences already whole: never one still replaying
                assert all(s.active[row.slot].replay_end is None for row in plan.rows)
            else:
                assert all(not row.emit for row in plan.rows) and plan.window == (2, 4)
                for row in plan.rows:
                    seen[row.slot].extend(range(row.start, row.start + len(row.tokens)))
            s.apply_result(plan, {row.slot: (60, -0.1) for row in plan.rows if row.emit}, 0.0)
    assert seen == {slot: list(range(n)) for slot, n in cached.items()}  # every cached position, once
    assert all(seq.cached >= cached[slot] for slot, seq in s.active.items())
    c = next(seq for seq in s.active.values() if seq.request.request_id == "c")
    assert c.generated, "the prompt it was prefilling went on in its micro-batch's turns, and ended with a token"


def settle(s, *prompts: tuple[str, int]) -> None:
    """Admit these prompts (max 30 new tokens) and run until every sequence is past its prefill."""
    for name, length in prompts:
        s.submit(GenerationRequest(name, list(range(1, length + 1)), max_new_tokens=30), 0.0)
    while s.waiting or any(seq.prefilling for seq in s.active.values()):
        plan = s.plan_step(0, 0.0)
        s.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows if row.emit}, 0.0)


def test_sequences_whole_again_decode_every_other_step_while_the_rest_replay():
    s = scheduler(slots=2, micro_batches=1)
    settle(s, ("long", 20))  # 20 prompt tokens and one generated: chunks of 8, 8 and 4, then one position
    settle(s, ("short", 3))  # 3 prompt tokens: one chunk, which waits until the long one's leave room
    s.replay_layers((1, 2))
    kinds = []
    for _ in range(8):
        plan = s.plan_step(0, 0.0)
        kinds.append("replay" if plan.window else "+".join(f"{row.slot}:{len(row.tokens)}" for row in plan.rows))
        s.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows if row.emit}, 0.0)
    # Slot 1 is whole after the third replay step (its chunk beside slot 0's last one); it decodes while slot 0
    # replays its generated position, after which both decode together.
    assert kinds == ["replay", "replay", "replay", "1:1", "replay", "0:1+1:1", "0:1+1:1", "0:1+1:1"], kinds


def test_a_lone_whole_sequence_gets_one_early_step_then_waits_until_the_whole_ones_are_as_many():
    s = scheduler(slots=3, micro_batches=1)
    settle(s, ("long1", 20), ("long2", 20))
    settle(s, ("short", 3))
    s.replay_layers((1, 2))
    kinds = []
    while not s.can_replay_layers():
        plan = s.plan_step(0, 0.0)
        kinds.append("replay" if plan.window else "whole")
        s.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows if row.emit}, 0.0)
    # One step for the short sequence as soon as it is whole (the first new token), then the replay goes on
    # alone while one sequence is whole against two replaying.
    assert kinds == ["replay", "replay", "replay", "whole", "replay", "replay", "replay", "replay"], kinds


def test_nothing_is_admitted_into_a_micro_batch_while_it_replays():
    s = scheduler(slots=2, micro_batches=1)
    s.submit(GenerationRequest("a", [1, 2, 3], max_new_tokens=4), 0.0)
    plan = s.plan_step(0, 0.0)
    s.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows}, 0.0)
    s.submit(GenerationRequest("b", [4, 5], max_new_tokens=4), 0.0)
    s.replay_layers((1, 2))
    replay = s.plan_step(0, 0.0)
    assert replay.window == (1, 2) and [row.slot for row in replay.rows] == [0] and len(s.waiting) == 1
    s.apply_result(replay, {}, 0.0)
    normal = s.plan_step(0, 0.0)
    assert normal.window is None and len(normal.rows) == 2 and not s.waiting


def test_a_full_reset_ends_a_replay():
    s = scheduler(slots=2, micro_batches=1)
    s.submit(GenerationRequest("a", [1, 2, 3], max_new_tokens=4), 0.0)
    plan = s.plan_step(0, 0.0)
    s.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows}, 0.0)
    s.replay_layers((1, 2))
    assert s.reset_caches() == 3
    plan = s.plan_step(0, 0.0)
    assert plan.window is None and plan.rows[0].start == 0 and len(plan.rows[0].tokens) == 3
