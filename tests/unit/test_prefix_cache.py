"""The prefix cache (broker/prefix_cache.py, stages/kv_cache.py): which prefix a prompt restores and saves, as
table tests of the pure index. tests/cluster/test_prefix_cache.py runs it on real stages."""

from __future__ import annotations

import pytest

from layerbus.planner.prefix_budget import PrefixCacheConfig, block_hashes
from layerbus.broker.prefix_cache import PrefixIndex
from layerbus.broker.requests import GenerationRequest, ScoreRequest, ScoreSegment
from layerbus.planner.batching import BatchingConfig
from layerbus.broker.scheduler import PlannedRow, Scheduler
from layerbus.wire import protocol
from layerbus.wire.frames import WireError

BLOCK = 4


def index(budget: int = 64) -> PrefixIndex:
    return PrefixIndex(PrefixCacheConfig(budget_tokens=budget, block_tokens=BLOCK))


def prompt(shared: int, tail: int, seed: int) -> list[int]:
    """`shared` tokens every prompt has, then `tail` of its own."""
    return list(range(100, 100 + shared)) + [1000 + seed * 50 + i for i in range(tail)]


# -- the pure index --------------------------------------------------------------------------------

def test_block_hashes_chain_over_every_token_before() -> None:
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK), block_hashes([1, 2, 3, 4, 5, 6, 7, 0], BLOCK)
    assert len(a) == 2 and len(b) == 2  # full blocks only
    assert a[0] == b[0] and a[1] != b[1]
    assert block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BLOCK)[1] != a[1], "block 2's hash covers block 1 too"


def test_a_prefix_is_saved_when_seen_again_and_restored_after() -> None:
    cache = index()
    first = cache.plan_prompt(prompt(12, 5, 0))
    assert (first.restore, first.save) == (None, None), "nothing seen yet: nothing kept on a guess"
    second = cache.plan_prompt(prompt(12, 5, 1))
    assert second.restore is None and second.save is not None and second.save[1] == 12
    third = cache.plan_prompt(prompt(12, 5, 2))
    assert third.restore is None, "the save's step has not come back: not every stage holds it yet"
    cache.step_done(None, second.save)
    fourth = cache.plan_prompt(prompt(12, 9, 3))
    assert fourth.restore == (second.save[0], 12) and fourth.save is None
    assert cache.stats.restored_tokens == 12 and cache.stats.hits == 1


@pytest.mark.parametrize(("length", "restored"), [(12, 8), (13, 12), (16, 12), (11, 8), (4, 0), (5, 4)])
def test_the_prompts_last_token_is_always_computed(length: int, restored: int) -> None:
    cache = index()
    saving = [cache.plan_prompt(list(range(16))) for _ in range(2)][1]
    cache.step_done(None, saving.save)
    plan = cache.plan_prompt(list(range(length)))
    assert (plan.restore[1] if plan.restore else 0) == restored


def test_a_longer_shared_prefix_is_saved_beyond_what_was_restored() -> None:
    cache = index()
    for seed in (0, 1):
        plan = cache.plan_prompt(prompt(8, 6, seed))
    cache.step_done(None, plan.save)  # 8 tokens kept
    cache.plan_prompt(prompt(16, 3, 7))  # 16 shared tokens seen once
    longer = cache.plan_prompt(prompt(16, 3, 8))
    assert longer.restore[1] == 8 and longer.save[1] == 16


def test_the_budget_evicts_least_recently_used_and_never_a_pinned_entry() -> None:
    cache = index(budget=16)
    saves = []
    for group in range(3):
        plans = [cache.plan_prompt([group] * 8 + [50 + seed]) for seed in range(2)]
        cache.step_done(None, plans[1].save)
        saves.append(plans[1].save)
        assert cache.used_tokens <= 16
    assert [entry.entry_id for entry in cache.entries.values()] == [saves[1][0], saves[2][0]]
    assert cache.take_drops() == [saves[0][0]] and cache.stats.evicted_entries == 1
    pinned = cache.plan_prompt([1] * 8 + [99])  # restores group 1's entry: pinned while its step is out
    assert pinned.restore[0] == saves[1][0]
    for seed in range(2):
        blocked = cache.plan_prompt([7] * 16 + [seed])
    assert blocked.save is None, "16 more tokens fit only by evicting the pinned entry: not saved"
    cache.step_done(pinned.restore, None)
    now_fits = cache.plan_prompt([7] * 16 + [2])
    assert now_fits.save is not None and cache.used_tokens == 16


def test_a_failed_save_is_dropped_and_a_failed_restore_uncounted() -> None:
    cache = index()
    plans = [cache.plan_prompt(prompt(8, 2, seed)) for seed in range(2)]
    cache.step_failed(None, plans[1].save)
    assert cache.take_drops() == [plans[1].save[0]] and not cache.entries
    again = cache.plan_prompt(prompt(8, 2, 5))
    cache.step_done(None, again.save)
    restoring = cache.plan_prompt(prompt(8, 2, 6))
    cache.step_failed(restoring.restore, None)
    assert cache.stats.restored_tokens == 0 and cache.stats.hits == 0
    assert next(iter(cache.entries.values())).pins == 0


def test_clear_forgets_every_entry() -> None:
    cache = index()
    plans = [cache.plan_prompt(prompt(8, 2, seed)) for seed in range(2)]
    cache.step_done(None, plans[1].save)
    cache.clear()
    assert cache.plan_prompt(prompt(8, 2, 3)).restore is None


# -- the scheduler and the wire ---------------------------------------------------------------------

def test_the_scheduler_starts_a_restored_row_past_its_prefix_and_saves_where_the_chunk_reaches() -> None:
    config = BatchingConfig(num_slots=1, num_micro_batches=1, max_step_tokens=6,
                            prefix_cache=PrefixCacheConfig(budget_tokens=64, block_tokens=BLOCK))
    scheduler = Scheduler(config, 1, eos_ids={0}, prefix_cache=PrefixIndex(config.prefix_cache))
    rows_seen = []
    for seed in range(3):
        scheduler.submit(GenerationRequest(f"r{seed}", prompt(12, 3, seed), max_new_tokens=1), now=0.0)
        while True:
            plan = scheduler.plan_step(0, now=0.0)
            if plan is None:
                break
            rows_seen.append((seed, plan.rows[0]))
            if scheduler.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows if row.emit}, now=0.0):
                break
    first_rows = {seed: [row for s, row in rows_seen if s == seed] for seed in range(3)}
    assert [row.start for row in first_rows[0]] == [0, 6, 12], "no cache yet: the whole prompt in chunks of 6"
    assert [row.save is not None for row in first_rows[1]] == [False, True, False], "saved by the chunk reaching 12"
    restored = first_rows[2][0]
    assert restored.start == 12 and restored.restore[1] == 12 and restored.tokens == prompt(12, 3, 2)[12:]


def score_request(seed: int, shared: int = 12) -> ScoreRequest:
    """A two-choice question whose context starts with `shared` tokens every question has."""
    return ScoreRequest(f"q{seed}", (ScoreSegment(tuple(prompt(shared, 3, seed)), ((7, 8), (9,))),))


def run_scores(scheduler: Scheduler, seed: int, fail_first_restore: bool = False) -> list[PlannedRow]:
    """Feed one question through a 1-slot scheduler to its end; the rows sent (a failed one included)."""
    scheduler.submit(score_request(seed), now=0.0)
    sent = []
    while True:
        plan = scheduler.plan_step(0, now=0.0)
        assert plan is not None
        sent.append(plan.rows[0])
        if fail_first_restore and plan.rows[0].restore is not None:
            fail_first_restore = False
            scheduler.fail_step(plan, "a stage fell over", now=0.0)
            continue
        row = plan.rows[0]
        scores = {row.slot: ([-0.5] * len(row.tokens), [True] * len(row.tokens))} if row.targets else None
        if scheduler.apply_result(plan, {}, now=0.0, scores=scores):
            return sent


def score_scheduler() -> Scheduler:
    config = BatchingConfig(num_slots=1, num_micro_batches=1, max_step_tokens=6,
                            prefix_cache=PrefixCacheConfig(budget_tokens=64, block_tokens=BLOCK))
    return Scheduler(config, 1, eos_ids={0}, prefix_cache=PrefixIndex(config.prefix_cache))


def test_an_eval_context_is_saved_when_seen_again_and_restored_after_and_its_choices_fed_as_before() -> None:
    scheduler = score_scheduler()
    rows = {seed: run_scores(scheduler, seed) for seed in range(3)}
    context = prompt(12, 3, 2)
    # The context phase is context[:-1] (14 tokens): no cache yet, chunks of 6 from 0.
    assert [row.start for row in rows[0] if row.targets is None] == [0, 6, 12]
    assert [row.save is not None for row in rows[1] if row.targets is None] == [False, True, False]
    first = rows[2][0]
    assert first.restore[1] == 12 and first.start == 12 and first.tokens == context[12:-1], "restored past the shared 12"
    # The choices are fed from the context's last token, as without the cache.
    assert [(row.start, row.tokens, row.targets) for row in rows[2] if row.targets] == [
        (14, [context[-1], 7], [7, 8]), (14, [context[-1]], [9])]
    stats = scheduler.prefix_cache.stats
    assert (stats.hits, stats.restored_tokens, stats.saved_entries) == (1, 12, 1)
    assert stats.prompt_tokens == 3 * (14 + 2 + 1), "every position a question computes without the cache"


def test_a_failed_restoring_step_makes_the_eval_context_compute_from_position_0() -> None:
    scheduler = score_scheduler()
    for seed in range(2):
        run_scores(scheduler, seed)
    sent = run_scores(scheduler, 2, fail_first_restore=True)
    assert sent[0].restore is not None and sent[0].start == 12
    assert sent[1].restore is None and sent[1].start == 0, "the retry holds nothing restored: it starts at 0"
    assert [row.start for row in sent[1:] if row.targets is None] == [0, 6, 12]
    assert scheduler.prefix_cache.stats.restored_tokens == 0


def test_prefix_ops_are_checked_against_their_rows() -> None:
    rows = [protocol.StepRow(slot=3, start=8, length=4), protocol.StepRow(slot=4, start=0, length=6)]
    ops = protocol.prefix_ops_from_json({"restore": [[3, 1, 8]], "save": [[4, 2, 4]], "drop": [0]}, rows)
    assert (ops.restore, ops.save, ops.drop) == ([(3, 1, 8)], [(4, 2, 4)], [0])
    for bad in ({"restore": [[3, 1, 4]]}, {"save": [[4, 2, 7]]}, {"restore": [[9, 1, 8]]}, {"save": [[4, 2]]},
                {"drop": ["x"]}, {"copy": []}, [1]):
        with pytest.raises(WireError):
            protocol.prefix_ops_from_json(bad, rows)


# -- real stages --------------------------------------------------------------------------------------


def test_prompts_wait_a_step_for_a_prefix_being_saved_rather_than_compute_it() -> None:
    """At a job's start every slot holds an item with the same system prompt: after the first repeat starts
    saving it, the rest wait for the save instead of all computing it (unless the step would be empty)."""
    config = BatchingConfig(num_slots=6, num_micro_batches=1, max_step_tokens=64,
                            prefix_cache=PrefixCacheConfig(budget_tokens=64, block_tokens=BLOCK))
    scheduler = Scheduler(config, 1, eos_ids={0}, prefix_cache=PrefixIndex(config.prefix_cache))
    for seed in range(6):
        scheduler.submit(GenerationRequest(f"r{seed}", prompt(12, 3, seed), max_new_tokens=2), now=0.0)
    first = scheduler.plan_step(0, now=0.0)
    assert [(row.start, row.save is not None) for row in first.rows] == [(0, False), (0, True)]
    scheduler.apply_result(first, {row.slot: (7, -0.1) for row in first.rows if row.emit}, now=0.0)
    second = scheduler.plan_step(0, now=0.0)
    prefills = [row for row in second.rows if len(row.tokens) > 1]
    assert [(row.start, row.restore[1]) for row in prefills] == [(12, 12)] * 4, "the other four copy it"
    assert scheduler.prefix_cache.stats.restored_tokens == 48


def test_a_new_run_keeps_what_every_stage_holds_and_drops_unfinished_saves() -> None:
    cache = index()
    plans = [cache.plan_prompt(prompt(8, 2, seed)) for seed in range(2)]
    cache.step_done(None, plans[1].save)
    unfinished = [cache.plan_prompt(prompt(12, 2, seed)) for seed in range(2)][1].save
    cache.start_run()
    assert cache.take_drops() == [unfinished[0]] and cache.stats.prompts == 0
    assert cache.plan_prompt(prompt(8, 2, 9)).restore == (plans[1].save[0], 8)


def grouped_run(lookahead: int) -> tuple[list[str], PrefixIndex]:
    """Two tasks' items interleaved in the queue (each task's 12-token prefix, then 3 of the item's own),
    through one slot, with room in the cache for one task's prefix only: the admission order, and the index."""
    config = BatchingConfig(num_slots=1, num_micro_batches=1, max_step_tokens=32,
                            prefix_cache=PrefixCacheConfig(budget_tokens=12, block_tokens=BLOCK,
                                                           admit_lookahead=lookahead))
    cache = PrefixIndex(config.prefix_cache)
    scheduler = Scheduler(config, 1, eos_ids={0}, prefix_cache=cache)
    for i in range(8):
        task = "ab"[i % 2]
        base = 100 if task == "a" else 500
        scheduler.submit(GenerationRequest(f"{task}{i}", list(range(base, base + 12)) + [1000 + 10 * i, 1001 + 10 * i,
                                                                                         1002 + 10 * i],
                                           max_new_tokens=1), now=0.0)
    order = []
    while not scheduler.idle:
        plan = scheduler.plan_step(0, now=0.0)
        order.extend(scheduler.active[row.slot].request.request_id for row in plan.rows
                     if row.start == 0 or row.restore is not None)
        scheduler.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows if row.emit}, now=0.0)
    return order, cache


def test_admission_groups_items_that_share_a_prefix_so_the_cache_restores_it():
    fifo_order, fifo = grouped_run(lookahead=1)
    grouped_order, grouped = grouped_run(lookahead=8)
    assert fifo_order == [f"{'ab'[i % 2]}{i}" for i in range(8)]
    # Grouped, a's items go in together, then b's: the prefix saved the second time it is seen serves the rest,
    # where interleaved each task's save evicts the other's before it is used.
    assert grouped_order == ["a0", "a2", "a4", "a6", "b1", "b3", "b5", "b7"], grouped_order
    assert (fifo.stats.hits, grouped.stats.hits) == (0, 4), (fifo.stats, grouped.stats)  # all but 2 of each task


def test_an_item_passed_over_for_shared_prefixes_waits_at_most_the_lookahead():
    config = BatchingConfig(num_slots=1, num_micro_batches=1, max_step_tokens=32,
                            prefix_cache=PrefixCacheConfig(budget_tokens=64, block_tokens=BLOCK, admit_lookahead=3))
    scheduler = Scheduler(config, 1, eos_ids={0}, prefix_cache=PrefixIndex(config.prefix_cache))
    scheduler.submit(GenerationRequest("shared0", prompt(12, 3, 0), max_new_tokens=1), now=0.0)
    scheduler.submit(GenerationRequest("loner", list(range(900, 915)), max_new_tokens=1), now=0.0)
    for seed in range(1, 10):
        scheduler.submit(GenerationRequest(f"shared{seed}", prompt(12, 3, seed), max_new_tokens=1), now=0.0)
    order = []
    while not scheduler.idle:
        plan = scheduler.plan_step(0, now=0.0)
        order.extend(scheduler.active[row.slot].request.request_id for row in plan.rows if row.emit)
        scheduler.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows if row.emit}, now=0.0)
    assert order.index("loner") == 4, order  # passed over 3 times, then admitted
