"""Score requests (evals) through the scheduler, against a fake model whose log-probs and argmax
depend only on the history a stage holds: whatever the chunking, interleaving, rewinds and lost
caches, each continuation's scores must be those of context + continuation read in one pass."""

from __future__ import annotations

import random

import pytest

from layerbus.broker.requests import ScoreRequest, ScoreSegment
from layerbus.planner.batching import BatchingConfig
from layerbus.broker.scheduler import Scheduler, StepPlan
from layerbus.broker.scoring import Phase, ScoringFeed, phases_of


def fake_logprob(history: list[int], target: int) -> float:
    return -((sum(history) * 7 + target * 3 + len(history)) % 97) / 10.0


def fake_argmax(history: list[int]) -> int:
    return (sum(history) * 5 + len(history)) % 11


def expected_scores(request: ScoreRequest) -> list[tuple[list[float], list[bool]]]:
    out = []
    for segment in request.segments:
        for continuation in segment.continuations:
            history = list(segment.context_ids)
            logprobs, greedy = [], []
            for token in continuation:
                logprobs.append(fake_logprob(history, token))
                greedy.append(fake_argmax(history) == token)
                history.append(token)
            out.append((logprobs, greedy))
    return out


class FakeScoringStages:
    """Slot histories, rewound at a row's start as KVArena does; scores each targeted position."""

    def __init__(self):
        self.history: dict[int, list[int]] = {}
        self.positions = 0

    def run(self, plan: StepPlan) -> dict[int, tuple[list[float], list[bool]]]:
        for slot in plan.released:
            self.history.pop(slot, None)
        scores = {}
        for row in plan.rows:
            held = self.history.get(row.slot, [])
            assert row.start <= len(held), f"slot {row.slot}: row starts at {row.start}, {len(held)} cached"
            held = held[:row.start]
            logprobs, greedy = [], []
            for i, token in enumerate(row.tokens):
                held.append(token)
                if row.targets and i < len(row.targets):
                    logprobs.append(fake_logprob(held, row.targets[i]))
                    greedy.append(fake_argmax(held) == row.targets[i])
            self.positions += len(row.tokens)
            self.history[row.slot] = held
            if row.targets:
                scores[row.slot] = (logprobs, greedy)
        return scores


def make(num_slots=4, micro_batches=2, max_step_tokens=256, max_context=2048) -> Scheduler:
    config = BatchingConfig(num_slots=num_slots, num_micro_batches=micro_batches, max_step_tokens=max_step_tokens,
                            max_context=max_context)
    return Scheduler(config, num_stages=1, eos_ids={0})


def random_request(rng: random.Random, rid: str) -> ScoreRequest:
    segments = []
    for _ in range(rng.choice([1, 1, 1, 3])):
        context = tuple(rng.randint(1, 50) for _ in range(rng.randint(1, 40)))
        continuations = tuple(tuple(rng.randint(1, 50) for _ in range(rng.randint(1, 12)))
                              for _ in range(rng.randint(1, 5)))
        segments.append(ScoreSegment(context, continuations))
    return ScoreRequest(rid, tuple(segments))


# -- the feed, as a table --------------------------------------------------------------------------

@pytest.mark.parametrize("segments, expected", [
    pytest.param([((5, 6, 7), ((8, 9), (10,)))],
                 [Phase(0, (5, 6), None, None), Phase(2, (7, 8), (8, 9), 0), Phase(2, (7,), (10,), 1)],
                 id="context prefilled once, each choice re-feeds its last token"),
    pytest.param([((1,), ((2, 3, 4),))], [Phase(0, (1, 2, 3), (2, 3, 4), 0)],
                 id="one-token context: no prefill phase"),
    pytest.param([((1, 2), ((3,),)), ((4, 5, 6), ((7,),))],
                 [Phase(0, (1,), None, None), Phase(1, (2,), (3,), 0), Phase(0, (4, 5), None, None),
                  Phase(2, (6,), (7,), 1)],
                 id="rolling windows: each segment starts again at position 0"),
])
def test_phases_of_a_request(segments, expected) -> None:
    request = ScoreRequest("r", tuple(ScoreSegment(c, k) for c, k in segments))
    assert phases_of(request) == expected


def test_a_four_choice_question_computes_its_context_once() -> None:
    context, choices = tuple(range(1, 51)), tuple((100 + i, 200 + i, 300) for i in range(4))
    feed = ScoringFeed(ScoreRequest("q", (ScoreSegment(context, choices),)))
    # 49 context positions, then 4 x (1 re-fed context token + 2 choice tokens): not 4 x 52.
    assert feed.positions == 49 + 4 * 3


def test_feed_refuses_scores_that_do_not_match_the_chunk() -> None:
    feed = ScoringFeed(ScoreRequest("r", (ScoreSegment((1,), ((2, 3),)),)))
    chunk = feed.next_chunk(8)
    with pytest.raises(ValueError, match="returned 1 scores for a chunk of 2"):
        feed.apply(len(chunk.tokens), [-1.0], [True])


def test_segments_refuse_empty_contexts_and_continuations() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        ScoreSegment((), ((1,),))
    with pytest.raises(ValueError, match="at least one token"):
        ScoreSegment((1,), ((1,), ()))


# -- through the scheduler -------------------------------------------------------------------------

def run(scheduler: Scheduler, stages: FakeScoringStages, rng: random.Random | None = None, reset_rate: float = 0.0):
    results, resets = {}, 0
    for i in range(50_000):
        if scheduler.idle:
            return results, resets
        if rng is not None and rng.random() < reset_rate:
            resets += 1
            scheduler.reset_caches()
            stages.history.clear()
        plan = scheduler.plan_step(i % scheduler.num_micro_batches, float(i))
        if plan is None:
            continue
        for result in scheduler.apply_result(plan, {}, float(i), stages.run(plan)):
            assert result.request_id not in results
            results[result.request_id] = result
    raise AssertionError("scheduler did not become idle")


@pytest.mark.parametrize("seed", range(8))
def test_scores_do_not_depend_on_chunking_interleaving_or_lost_caches(seed: int) -> None:
    rng = random.Random(seed)
    scheduler = make(num_slots=rng.choice([1, 3, 6]), micro_batches=rng.choice([1, 2, 3]),
                     max_step_tokens=rng.choice([3, 8, 64]))
    requests = [random_request(rng, f"r{i}") for i in range(12)]
    for request in requests:
        assert scheduler.submit(request, 0.0) is None
    results, resets = run(scheduler, FakeScoringStages(), rng, reset_rate=0.05 if seed % 2 else 0.0)
    assert sorted(results) == sorted(r.request_id for r in requests)
    for request in requests:
        result = results[request.request_id]
        assert result.error is None and result.finish_reason == "stop" and result.token_ids == []
        got = [(list(s.logprobs), list(s.greedy)) for s in result.scores]
        assert got == expected_scores(request), request.request_id
        assert result.prompt_tokens == ScoringFeed(request).positions


def test_scoring_and_generation_share_a_micro_batch() -> None:
    from layerbus.broker.requests import GenerationRequest

    scheduler, stages = make(num_slots=2, micro_batches=1), FakeScoringStages()
    score = ScoreRequest("s", (ScoreSegment((1, 2, 3), ((4, 5), (6,))),))
    assert scheduler.submit(score, 0.0) is None
    assert scheduler.submit(GenerationRequest("g", [1, 2], max_new_tokens=3), 0.0) is None
    results = {}
    for i in range(20):
        plan = scheduler.plan_step(0, float(i))
        if plan is None:
            break
        scores = stages.run(plan)
        tokens = {row.slot: (7, -0.5) for row in plan.rows if row.emit}
        for result in scheduler.apply_result(plan, tokens, float(i), scores):
            results[result.request_id] = result
    assert results["g"].token_ids == [7, 7, 7]
    assert [list(s.logprobs) for s in results["s"].scores] == [lp for lp, _ in expected_scores(score)]


def test_a_request_past_the_context_budget_is_refused_at_once() -> None:
    scheduler = make(max_context=10)
    result = scheduler.submit(ScoreRequest("long", (ScoreSegment(tuple(range(1, 9)), ((1, 2, 3, 4),)),)), 0.0)
    assert result is not None and result.finish_reason == "error"
    assert "reach position 11, past the context of 10 tokens" in result.error
    assert scheduler.submit(ScoreRequest("fits", (ScoreSegment(tuple(range(1, 8)), ((1, 2, 3, 4),)),)), 0.0) is None


def chunks_of(request_id: str, scheduler: Scheduler, stages: FakeScoringStages, others=()) -> list[tuple[int, int]]:
    """(start, length) of every row the request was sent as."""
    target = ScoreRequest(request_id, (ScoreSegment(tuple(range(1, 41)), ((5, 6, 7), tuple(range(1, 30)))),))
    for request in (*others, target):
        assert scheduler.submit(request, 0.0) is None
    slots, seen = {}, []
    for i in range(10_000):
        if scheduler.idle:
            return seen
        plan = scheduler.plan_step(i % scheduler.num_micro_batches, float(i))
        if plan is None:
            continue
        for row in plan.rows:
            seq = scheduler.active[row.slot]
            if seq.request.request_id == request_id:
                seen.append((row.start, len(row.tokens)))
        scheduler.apply_result(plan, {row.slot: (7, -0.1) for row in plan.rows if row.emit}, float(i), stages.run(plan))
    raise AssertionError("not idle")


def test_a_requests_chunks_do_not_depend_on_what_shares_its_steps() -> None:
    """Same cuts alone or among others: its scores cannot move with the batch (lm-eval #704, #1645)."""
    from layerbus.broker.requests import GenerationRequest

    alone = chunks_of("t", make(num_slots=1, micro_batches=1, max_step_tokens=16),
                      FakeScoringStages())
    rng = random.Random(3)
    crowd = [random_request(rng, f"o{i}") for i in range(6)] + [GenerationRequest(f"g{i}", [1, 2, 3], 20)
                                                                 for i in range(3)]
    crowded = chunks_of("t", make(num_slots=5, micro_batches=1, max_step_tokens=16),
                        FakeScoringStages(), crowd)
    assert crowded == alone
    assert alone == [(0, 16), (16, 16), (32, 7), (39, 3), (39, 16), (55, 13)]
