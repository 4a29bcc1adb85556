"""The continuous-batching scheduler, driven without sockets: a fake chain of stages keeps each
slot's token history the way the KV caches would, and answers with a deterministic "model"."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.planner.batching import BatchingConfig
from layerbus.broker.scheduler import prefill_chunk_end
from layerbus.broker.scheduler import PlannedRow, Scheduler, StepPlan

EOS = 0
VOCAB = 97


def next_token(history: list[int]) -> int:
    """The fake model: the next token is a fixed function of everything the slot holds."""
    return (history[-1] * 7 + len(history) * 3 + sum(history)) % VOCAB


def detokenize(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


class LetterTokenizer:
    """The fake model's tokenizer: one letter per token."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return detokenize(ids)


def letters() -> IncrementalDetokenizer:
    return IncrementalDetokenizer(LetterTokenizer())


def logprob_of(token: int) -> float:
    return -token / 100.0


def request(rid: str, prompt_len: int = 4, max_new_tokens: int = 8, first: int = 1, **kwargs) -> GenerationRequest:
    return GenerationRequest(rid, [first + i for i in range(prompt_len)], max_new_tokens=max_new_tokens, **kwargs)


def reference(req: GenerationRequest, max_context: int, eos: set[int] = frozenset({EOS})) -> tuple[list[int], str]:
    """What the request must produce: greedy decoding with the fake model, same stop rules."""
    out: list[int] = []
    while True:
        out.append(next_token(list(req.prompt_ids) + out))
        if out[-1] in eos or any(stop and stop in detokenize(out) for stop in req.stop):
            return out, "stop"
        if len(out) >= req.max_new_tokens or len(req.prompt_ids) + len(out) >= max_context:
            return out, "length"


@dataclass
class FakeStages:
    """What the stages hold per slot (token ids standing in for keys/values), checked like KVArena."""

    history: dict[int, list[int]] = field(default_factory=dict)
    steps: int = 0

    def run(self, plan: StepPlan) -> dict[int, tuple[int, float]]:
        self.steps += 1
        for slot in plan.released:
            self.history.pop(slot, None)
        out = {}
        for row in plan.rows:
            held = self.history.get(row.slot, [])
            assert row.start <= len(held), f"slot {row.slot}: step starts at {row.start}, {len(held)} cached"
            self.history[row.slot] = held[:row.start] + list(row.tokens)
            if row.emit:
                token = next_token(self.history[row.slot])
                out[row.slot] = (token, logprob_of(token))
        return out


def make(num_slots: int = 4, micro_batches: int = 2, max_step_tokens: int = 256,
         max_context: int = 2048, stop_strings: bool = True) -> Scheduler:
    config = BatchingConfig(num_slots=num_slots, num_micro_batches=micro_batches, max_step_tokens=max_step_tokens,
                            max_context=max_context)
    return Scheduler(config, num_stages=1, eos_ids={EOS}, new_detokenizer=letters if stop_strings else None)


def step(scheduler: Scheduler, stages: FakeStages, mb: int, now: float = 0.0) -> tuple[StepPlan | None,
                                                                                    list[GenerationResult]]:
    plan = scheduler.plan_step(mb, now)
    if plan is None:
        return None, []
    return plan, scheduler.apply_result(plan, stages.run(plan), now)


def submit_all(scheduler: Scheduler, requests: list[GenerationRequest]) -> None:
    for req in requests:
        assert scheduler.submit(req, 0.0) is None


def run_until_idle(scheduler: Scheduler, stages: FakeStages, limit: int = 10_000) -> dict[str, GenerationResult]:
    results: dict[str, GenerationResult] = {}
    for i in range(limit):
        if scheduler.idle:
            return results
        for result in step(scheduler, stages, i % scheduler.num_micro_batches, now=float(i))[1]:
            assert result.request_id not in results
            results[result.request_id] = result
    raise AssertionError("scheduler did not become idle")


# -- configuration and slot layout ----------------------------------------------------------------

LAYOUTS = {
    "10 slots, 3 micro-batches": (10, 3, 1, [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]),
    "4 slots, 2 micro-batches": (4, 2, 1, [[0, 1], [2, 3]]),
    "auto: stages + 1": (6, 0, 2, [[0, 1], [2, 3], [4, 5]]),
    "more micro-batches than slots": (2, 5, 1, [[0], [1]]),
    "auto capped by slots": (2, 0, 4, [[0], [1]]),
    "one slot": (1, 0, 1, [[0]]),
}


@pytest.mark.parametrize("num_slots, micro_batches, num_stages, expected", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_micro_batches_own_adjacent_slots(num_slots: int, micro_batches: int, num_stages: int,
                                          expected: list[list[int]]) -> None:
    config = BatchingConfig(num_slots=num_slots, num_micro_batches=micro_batches)
    scheduler = Scheduler(config, num_stages=num_stages, eos_ids={EOS})
    assert scheduler.num_micro_batches == len(expected)
    assert scheduler.slots_of == expected


@pytest.mark.parametrize("fields, message", [
    # 0 micro-batch size and 0 step tokens mean "chosen by the broker": only negatives are refused.
    ({"num_slots": -1}, r"need num_slots >= 0, micro_batch_size >= 0 \(0 = chosen\) and num_micro_batches >= 0"),
    ({"micro_batch_size": -1}, r"self.micro_batch_size=-1"),
    ({"max_step_tokens": -1}, r"max_step_tokens must be >= 0 \(0 = chosen\), got -1"),
    ({"max_context": 1}, r"max_context must be >= 2, got 1"),
], ids=["negative slots", "negative micro-batches", "negative step budget", "context of one"])
def test_batching_config_rejects_bad_budgets(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchingConfig(**fields)


# -- admission ------------------------------------------------------------------------------------

def test_admission_fills_the_planned_micro_batch_in_arrival_order() -> None:
    scheduler = make(num_slots=4, micro_batches=2)
    submit_all(scheduler, [request(f"r{i}") for i in range(5)])
    assert scheduler.free_slots() == 4
    plan = scheduler.plan_step(0, 0.0)
    assert {s: scheduler.active[s].request.request_id for s in scheduler.active} == {0: "r0", 1: "r1"}
    assert [row.slot for row in plan.rows] == [0, 1]
    scheduler.plan_step(1, 0.0)
    assert {s: scheduler.active[s].request.request_id for s in scheduler.active} == {0: "r0", 1: "r1", 2: "r2",
                                                                                     3: "r3"}
    assert [r.request_id for r in scheduler.waiting] == ["r4"]
    assert scheduler.free_slots() == 0


def test_an_empty_micro_batch_has_no_step() -> None:
    scheduler = make()
    assert scheduler.plan_step(0, 0.0) is None
    assert scheduler.idle


def test_first_rows_carry_the_prompt_from_position_zero() -> None:
    scheduler = make(num_slots=2, micro_batches=1)
    submit_all(scheduler, [request("a", prompt_len=3, first=10), request("b", prompt_len=5, first=20)])
    plan = scheduler.plan_step(0, 0.0)
    assert plan.rows == [PlannedRow(0, 0, [10, 11, 12], True), PlannedRow(1, 0, [20, 21, 22, 23, 24], True)]
    assert plan.released == []


def test_decode_rows_feed_the_last_generated_token_at_the_cached_length() -> None:
    scheduler, stages = make(num_slots=2, micro_batches=1), FakeStages()
    submit_all(scheduler, [request("a", prompt_len=3), request("b", prompt_len=6)])
    step(scheduler, stages, 0)
    plan = scheduler.plan_step(0, 1.0)
    generated = {slot: scheduler.active[slot].generated for slot in (0, 1)}
    assert plan.rows == [PlannedRow(0, 3, [generated[0][-1]], True), PlannedRow(1, 6, [generated[1][-1]], True)]


def test_freed_slot_is_refilled_at_its_micro_batch_next_step() -> None:
    scheduler, stages = make(num_slots=4, micro_batches=2), FakeStages()
    submit_all(scheduler, [request("short", max_new_tokens=1), request("long", max_new_tokens=50),
                           request("other-mb", max_new_tokens=50)])
    plan0, done = step(scheduler, stages, 0)
    assert [r.request_id for r in done] == ["short"]
    plan1 = scheduler.plan_step(1, 0.0)  # micro-batch 1's step is now "in flight" and stays so
    assert [row.slot for row in plan1.rows] == [2]
    assert scheduler.submit(request("late", prompt_len=5, first=30), 1.0) is None
    plan = scheduler.plan_step(0, 1.0)
    assert plan.released == [0]
    assert scheduler.active[0].request.request_id == "late"
    assert plan.rows == [PlannedRow(0, 0, [30, 31, 32, 33, 34], True),
                         PlannedRow(1, 4, [scheduler.active[1].generated[-1]], True)]


# -- chunked prefill ------------------------------------------------------------------------------

def test_long_prompt_is_prefilled_in_chunks_and_emits_only_on_the_last() -> None:
    scheduler, stages = make(num_slots=1, micro_batches=1, max_step_tokens=8), FakeStages()
    submit_all(scheduler, [request("p", prompt_len=20, max_new_tokens=2, first=100)])
    chunks = []
    for _ in range(3):
        plan, done = step(scheduler, stages, 0)
        assert done == []
        (row,) = plan.rows
        chunks.append((row.start, len(row.tokens), row.emit))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert scheduler.active[0].generated == [next_token(list(range(100, 120)))]


@pytest.mark.parametrize("decoding, max_step_tokens, expected_chunk", [
    (2, 8, 8),  # the decode rows leave 6: the chunk goes whole, the step runs over rather than cut it elsewhere
    (7, 8, 8),
    (2, 16, 16),
], ids=["budget left after decodes", "budget nearly spent", "room enough"])
def test_a_prompt_chunk_is_cut_at_a_multiple_of_the_budget_whatever_the_decode_rows_leave(
        decoding: int, max_step_tokens: int, expected_chunk: int) -> None:
    """The same cuts in every run (a re-plan's re-prefill, a rerun, another batch): a kernel given another cut
    rounds differently, and a greedy token at a near-tie could flip."""
    scheduler = make(num_slots=decoding + 1, micro_batches=1, max_step_tokens=max_step_tokens)
    stages = FakeStages()
    submit_all(scheduler, [request(f"d{i}", prompt_len=1, max_new_tokens=100, first=40) for i in range(decoding)])
    step(scheduler, stages, 0)
    submit_all(scheduler, [request("prefill", prompt_len=30, first=60)])
    plan = scheduler.plan_step(0, 0.0)
    decode_rows = [row for row in plan.rows if len(row.tokens) == 1 and row.start > 0]
    (prefill,) = [row for row in plan.rows if row.start == 0]
    assert len(decode_rows) == decoding
    assert len(prefill.tokens) == expected_chunk


def test_two_prefills_share_the_budget_and_the_second_waits_when_it_does_not_fit() -> None:
    scheduler, stages = make(num_slots=3, micro_batches=1, max_step_tokens=10), FakeStages()
    submit_all(scheduler, [request("a", prompt_len=4), request("b", prompt_len=9), request("c", prompt_len=9)])
    plan, _ = step(scheduler, stages, 0)
    # a's whole prompt (4), then b's (9) does not fit the 6 left: it waits rather than be cut there
    assert [(row.slot, row.start, len(row.tokens), row.emit) for row in plan.rows] == [(0, 0, 4, True)]
    plan, _ = step(scheduler, stages, 0)
    # a decodes (1), b's whole prompt fits the 9 left, c waits
    assert [(row.slot, row.start, len(row.tokens), row.emit) for row in plan.rows] == [(0, 4, 1, True),
                                                                                        (1, 0, 9, True)]
    plan, _ = step(scheduler, stages, 0)
    assert [(row.slot, row.start, len(row.tokens), row.emit) for row in plan.rows] == [(0, 5, 1, True),
                                                                                        (1, 9, 1, True),
                                                                                        (2, 0, 9, True)]


# -- finishing ------------------------------------------------------------------------------------

def find_prompt(predicate, max_context: int = 2048, **kwargs) -> GenerationRequest:
    """A prompt whose fake-model continuation has the wanted property (searched deterministically)."""
    for first in range(1, 500):
        req = request(f"first{first}", first=first, **kwargs)
        if predicate(req, reference(req, max_context)):
            return req
    raise AssertionError("no such prompt")


def finish_alone(req: GenerationRequest, max_context: int = 2048) -> GenerationResult:
    scheduler, stages = make(num_slots=1, micro_batches=1, max_context=max_context), FakeStages()
    submit_all(scheduler, [req])
    results = run_until_idle(scheduler, stages)
    assert list(results) == [req.request_id]
    return results[req.request_id]


def test_eos_stops_with_the_eos_token_included() -> None:
    req = find_prompt(lambda r, ref: ref[1] == "stop" and ref[0][-1] == EOS and len(ref[0]) > 1, max_new_tokens=200)
    result = finish_alone(req)
    assert result.finish_reason == "stop" and result.error is None
    assert result.token_ids[-1] == EOS and EOS not in result.token_ids[:-1]
    assert result.token_ids == reference(req, 2048)[0]
    assert result.stop_text_end is None


def test_max_new_tokens_ends_with_length() -> None:
    req = find_prompt(lambda r, ref: EOS not in ref[0], max_new_tokens=5)
    result = finish_alone(req)
    assert (result.finish_reason, len(result.token_ids), result.prompt_tokens) == ("length", 5, 4)
    assert result.completion_tokens == 5


def test_context_limit_ends_with_length() -> None:
    req = find_prompt(lambda r, ref: EOS not in ref[0], prompt_len=6, max_new_tokens=100, max_context=10)
    result = finish_alone(req, max_context=10)
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 4  # 6 prompt tokens + 4 new ones fill the 10-token context


def test_stop_string_ends_with_stop_and_says_where_it_starts() -> None:
    probe = request("probe", max_new_tokens=6)
    text = detokenize(reference(probe, 2048)[0])
    assert EOS not in reference(probe, 2048)[0]
    stop = text[3:5]  # a stop string that first appears in the 5th token's text
    req = GenerationRequest("s", probe.prompt_ids, max_new_tokens=50, stop=("never-there", stop))
    result = finish_alone(req)
    assert result.finish_reason == "stop"
    assert detokenize(result.token_ids).find(stop) == result.stop_text_end == text.find(stop)
    assert result.text == text[:text.find(stop)], "the result's text is cut before the stop string"
    assert len(result.token_ids) == text.find(stop) + 2


def test_stop_strings_are_ignored_without_a_detokenizer() -> None:
    probe = request("probe", max_new_tokens=6)
    stop = detokenize(reference(probe, 2048)[0])[:2]
    scheduler, stages = make(num_slots=1, micro_batches=1, stop_strings=False), FakeStages()
    submit_all(scheduler, [GenerationRequest("s", probe.prompt_ids, max_new_tokens=6, stop=(stop,))])
    (result,) = run_until_idle(scheduler, stages).values()
    assert (result.finish_reason, len(result.token_ids)) == ("length", 6)


def test_logprobs_and_latency_are_reported() -> None:
    req = GenerationRequest("lp", [5, 6, 7], max_new_tokens=3, want_logprobs=True)
    scheduler, stages = make(num_slots=1, micro_batches=1), FakeStages()
    submit_all(scheduler, [req])
    finished = []
    for now in (10.0, 11.0, 12.5):
        finished += step(scheduler, stages, 0, now)[1]
    (result,) = finished
    assert result.logprobs == [logprob_of(t) for t in result.token_ids]
    assert result.latency_s == pytest.approx(2.5)
    assert finish_alone(GenerationRequest("no-lp", [5, 6, 7], max_new_tokens=3)).logprobs is None


# -- refusals and failures ------------------------------------------------------------------------

def test_prompt_too_long_for_the_context_is_answered_at_once() -> None:
    scheduler = make(max_context=16)
    result = scheduler.submit(request("long", prompt_len=16), 0.0)
    assert (result.request_id, result.finish_reason, result.token_ids, result.prompt_tokens) == ("long", "error",
                                                                                                 [], 16)
    assert "prompt of 16 tokens does not fit the context of 16 tokens" in result.error
    assert "--max-context" in result.error
    assert scheduler.idle
    assert scheduler.submit(request("fits", prompt_len=15), 0.0) is None  # room for one new token


def test_empty_prompt_is_an_error() -> None:
    scheduler = make()
    result = scheduler.submit(GenerationRequest("empty", []), 0.0)
    assert (result.finish_reason, result.error, result.token_ids) == ("error", "empty prompt: nothing to generate from",
                                                                      [])
    assert scheduler.idle


def test_a_failed_step_makes_its_sequences_suspects_that_retry_one_per_step() -> None:
    scheduler, stages = make(num_slots=4, micro_batches=2), FakeStages()
    submit_all(scheduler, [request(f"r{i}", max_new_tokens=20) for i in range(5)])
    step(scheduler, stages, 0)
    step(scheduler, stages, 1)
    plan = scheduler.plan_step(0, 3.0)
    assert scheduler.fail_step(plan, "stage s1: RuntimeError: out of memory", 4.0) == []  # nobody blamed yet
    assert [scheduler.active[slot].suspect for slot in (0, 1)] == [True, True]
    retry = scheduler.plan_step(0, 5.0)
    assert [(row.slot, row.start) for row in retry.rows] == [(0, plan.rows[0].start)]  # the same row, alone
    scheduler.apply_result(retry, stages.run(retry), 5.0)
    assert not scheduler.active[0].suspect and scheduler.active[1].suspect
    assert [row.slot for row in scheduler.plan_step(0, 6.0).rows] == [1]


def test_a_sequence_failing_alone_ends_with_the_stage_error_and_frees_its_slot() -> None:
    config = BatchingConfig(num_slots=4, num_micro_batches=2, max_step_failures=1)
    scheduler, stages = Scheduler(config, num_stages=1, eos_ids={EOS}, new_detokenizer=letters), FakeStages()
    submit_all(scheduler, [request(f"r{i}", max_new_tokens=20) for i in range(5)])
    step(scheduler, stages, 0)
    step(scheduler, stages, 1)
    scheduler.active[1].suspect = True
    plan = scheduler.plan_step(0, 3.0)
    failed = scheduler.fail_step(plan, "stage s1: RuntimeError: bad input", 4.0)
    assert [(r.request_id, r.finish_reason, r.error) for r in failed] == [
        ("r1", "error", "stage s1: RuntimeError: bad input (failed alone 1 time(s))")]
    assert len(failed[0].token_ids) == 1  # the token from the prefill step survives
    plan = scheduler.plan_step(0, 5.0)
    assert plan.released == [1]
    assert scheduler.active[1].request.request_id == "r4"


@pytest.mark.parametrize("max_step_failures", [1, 2, 3])
def test_a_poison_item_fails_after_bounded_attempts_and_the_rest_match_the_reference(max_step_failures: int) -> None:
    config = BatchingConfig(num_slots=4, num_micro_batches=2, max_step_failures=max_step_failures)
    scheduler, stages = Scheduler(config, num_stages=1, eos_ids={EOS}, new_detokenizer=letters), FakeStages()
    requests = [request(f"r{i}", prompt_len=3 + i % 4, max_new_tokens=12, first=1 + 5 * i) for i in range(9)]
    requests.insert(4, request("poison", prompt_len=3, first=50))
    submit_all(scheduler, requests)
    results: dict[str, GenerationResult] = {}
    failed_steps = 0
    for i in range(10_000):
        if scheduler.idle:
            break
        plan = scheduler.plan_step(i % 2, float(i))
        if plan is None:
            continue
        if any(scheduler.active[row.slot].request.request_id == "poison" for row in plan.rows):
            failed_steps += 1
            finished = scheduler.fail_step(plan, "stage s0: ValueError: poisoned", float(i))
        else:
            finished = scheduler.apply_result(plan, stages.run(plan), float(i))
        for result in finished:
            assert result.request_id not in results
            results[result.request_id] = result
    assert sorted(results) == sorted(r.request_id for r in requests)
    poison = results.pop("poison")
    assert poison.finish_reason == "error"
    assert poison.error == f"stage s0: ValueError: poisoned (failed alone {max_step_failures} time(s))"
    assert failed_steps <= 1 + max_step_failures  # bounded: one step with neighbours, then alone
    for req in requests:
        if req.request_id in results:
            assert (results[req.request_id].token_ids, results[req.request_id].finish_reason) == \
                reference(req, 2048), req.request_id


@pytest.mark.parametrize("seed", range(6))
def test_losing_every_cache_at_random_steps_changes_no_output(seed: int) -> None:
    """A re-plan empties the stages' caches: sequences re-prefill what they know and go on."""
    rng = random.Random(seed)
    scheduler = make(num_slots=6, micro_batches=3, max_step_tokens=rng.choice([5, 16, 64]))
    stages = FakeStages()
    requests = [request(f"r{i}", prompt_len=rng.randint(1, 30), max_new_tokens=rng.randint(1, 25),
                        first=rng.randint(1, 90), score_prompt=rng.random() < 0.3) for i in range(14)]
    submit_all(scheduler, requests)
    results: dict[str, GenerationResult] = {}
    resets = 0
    for i in range(20_000):
        if scheduler.idle:
            break
        if rng.random() < 0.05:
            resets += 1
            scheduler.reset_caches()
            stages.history.clear()
        plan = scheduler.plan_step(i % 3, float(i))
        if plan is None:
            continue
        scores = {row.slot: ([-float(t) for t in row.targets], [False] * len(row.targets))
                  for row in plan.rows if row.targets}
        for result in scheduler.apply_result(plan, stages.run(plan), float(i), scores):
            results[result.request_id] = result
    assert resets > 0 and sorted(results) == sorted(r.request_id for r in requests)
    for req in requests:
        result = results[req.request_id]
        assert (result.token_ids, result.finish_reason) == reference(req, 2048), req.request_id
        if req.score_prompt:
            assert result.prompt_logprobs == [-float(t) for t in req.prompt_ids[1:]], req.request_id


def test_reset_caches_re_prefills_prompt_and_generated_tokens_without_emitting() -> None:
    """The prompt comes back as a chunk; each generated token's position one per step, as the decode step that
    first computed it did (a chunk's kernels round differently: a near-tie could flip a later token)."""
    scheduler, stages = make(num_slots=2, micro_batches=1), FakeStages()
    submit_all(scheduler, [request("a", prompt_len=4, max_new_tokens=10)])
    for i in range(4):
        step(scheduler, stages, 0, float(i))
    seq = scheduler.active[0]
    assert len(seq.generated) == 4 and seq.cached == 7
    assert scheduler.reset_caches() == 7
    assert scheduler.replaying == {0}
    plan = scheduler.plan_step(0, 5.0)
    assert [(row.start, row.tokens, row.emit) for row in plan.rows] == [(0, seq.known[:4], False)]
    stages.history.clear()
    for position in range(4, 7):
        scheduler.apply_result(plan, stages.run(plan), float(position))
        plan = scheduler.plan_step(0, float(position) + 0.5)
        assert [(row.start, row.tokens, row.emit) for row in plan.rows] == [(position, [seq.known[position]], False)]
    scheduler.apply_result(plan, stages.run(plan), 8.0)
    assert scheduler.replaying == set()
    plan = scheduler.plan_step(0, 9.0)
    assert [(row.start, row.tokens, row.emit) for row in plan.rows] == [(7, [seq.generated[-1]], True)]


@pytest.mark.parametrize("start, prompt, chunk, end", [
    (0, 10, 4, 4),  # within the prompt: at the next multiple of the step budget
    (3, 10, 4, 4),  # a chunk that began elsewhere (after a prefix copy) ends where a whole one would
    (4, 10, 4, 8),
    (8, 10, 4, 10),  # never past the prompt in one chunk
    (0, 10, 64, 10),
    (10, 10, 64, 11),  # a generated token's position: one at a time
    (12, 10, 64, 13),
])
def test_a_prompt_is_cut_at_the_same_places_and_generated_positions_go_one_at_a_time(start, prompt, chunk, end):
    assert prefill_chunk_end(start, prompt, chunk) == end


def test_released_slots_are_reported_once_on_their_own_micro_batch() -> None:
    scheduler, stages = make(num_slots=4, micro_batches=2), FakeStages()
    submit_all(scheduler, [request("a", max_new_tokens=1), request("b", max_new_tokens=30),
                           request("c", max_new_tokens=1), request("d", max_new_tokens=30)])
    step(scheduler, stages, 0)
    step(scheduler, stages, 1)
    plan1 = scheduler.plan_step(1, 1.0)
    assert plan1.released == [2]
    plan0 = scheduler.plan_step(0, 1.0)
    assert plan0.released == [0]
    scheduler.apply_result(plan0, stages.run(plan0), 1.0)
    assert scheduler.plan_step(0, 2.0).released == []


def test_a_step_with_only_releases_is_still_sent() -> None:
    scheduler, stages = make(num_slots=2, micro_batches=1), FakeStages()
    submit_all(scheduler, [request("a", max_new_tokens=1), request("b", max_new_tokens=1)])
    _, done = step(scheduler, stages, 0)
    assert len(done) == 2 and scheduler.idle
    plan = scheduler.plan_step(0, 1.0)
    assert plan == StepPlan(0, [], [0, 1])
    assert scheduler.plan_step(0, 2.0) is None


# -- the whole loop -------------------------------------------------------------------------------

def random_workload(rng: random.Random, count: int) -> list[GenerationRequest]:
    requests = []
    for i in range(count):
        stop = (rng.choice(["k", "m", "xy"]),) if rng.random() < 0.4 else ()
        requests.append(GenerationRequest(f"req{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))],
                                          max_new_tokens=rng.randint(1, 30), stop=stop))
    return requests


@pytest.mark.parametrize("seed, num_slots, micro_batches, max_step_tokens", [
    (0, 4, 2, 16),
    (1, 7, 3, 8),
    (2, 1, 1, 5),
    (3, 12, 4, 32),
], ids=["4 slots/2 mbs", "7 slots/3 mbs, small budget", "one slot", "12 slots/4 mbs"])
def test_every_request_finishes_exactly_once_with_the_reference_output(seed, num_slots, micro_batches,
                                                                       max_step_tokens) -> None:
    rng = random.Random(seed)
    max_context = 48
    scheduler = make(num_slots=num_slots, micro_batches=micro_batches, max_step_tokens=max_step_tokens,
                     max_context=max_context)
    stages = FakeStages()
    workload = random_workload(rng, 60)
    late = workload[40:]
    results: dict[str, GenerationResult] = {}
    submit_all(scheduler, workload[:40])
    in_flight: dict[int, StepPlan] = {}
    now = 0.0
    while not (scheduler.idle and not in_flight and not late):
        now += 1.0
        if late and rng.random() < 0.2:
            assert scheduler.submit(late.pop(0), now) is None
        for mb in range(scheduler.num_micro_batches):
            if mb not in in_flight and (plan := scheduler.plan_step(mb, now)) is not None:
                # A sequence is in one step at a time (at the tail it may move to another micro-batch:
                # Scheduler._balance_tail), no step carries more rows than a micro-batch's size, and a slot
                # is released with a step of the micro-batch that owns it (the one that refills it).
                busy = {row.slot for other in in_flight.values() for row in other.rows}
                assert not busy & {row.slot for row in plan.rows}
                assert len(plan.rows) <= scheduler.config.micro_batch_size
                assert set(plan.released) <= set(scheduler.slots_of[mb])
                prompt_len = {row.slot: len(scheduler.active[row.slot].request.prompt_ids) for row in plan.rows}
                decodes = [row for row in plan.rows if row.start >= prompt_len[row.slot]]
                chunks = [row for row in plan.rows if row.start < prompt_len[row.slot]]
                assert all(len(row.tokens) == 1 for row in decodes)
                # Each chunk ends where the prompt is cut in any run; only a step's first may run over budget.
                assert all(row.start + len(row.tokens) == min(prompt_len[row.slot], (row.start // max_step_tokens + 1)
                                                              * max_step_tokens) for row in chunks)
                total = sum(len(row.tokens) for row in chunks) + len(decodes)
                longest = max((len(row.tokens) for row in chunks if len(row.tokens) > 1), default=0)
                assert total - longest <= max_step_tokens
                in_flight[mb] = plan
        if not in_flight:
            continue
        mb = rng.choice(sorted(in_flight))  # results come back in any order across micro-batches
        plan = in_flight.pop(mb)
        for result in scheduler.apply_result(plan, stages.run(plan), now):
            assert result.request_id not in results, f"{result.request_id} finished twice"
            results[result.request_id] = result
        assert now < 10_000, "the loop is not making progress"
    assert sorted(results) == sorted(r.request_id for r in workload)
    for req in workload:
        tokens, reason = reference(req, max_context)
        got = results[req.request_id]
        assert (got.token_ids, got.finish_reason, got.error) == (tokens, reason, None), req.request_id
    assert scheduler.free_slots() == num_slots


@pytest.mark.parametrize("config, stages, slots, micro_batches", [
    (BatchingConfig(), 1, 32, 1),  # defaults: one micro-batch for one stage (see default_micro_batches)
    (BatchingConfig(), 3, 128, 4),
    (BatchingConfig(micro_batch_size=8), 2, 24, 3),
    (BatchingConfig(num_slots=10), 3, 10, 4),  # an explicit slot count wins
    (BatchingConfig(num_slots=2), 3, 2, 2),  # never more micro-batches than slots
    (BatchingConfig(num_slots=12, num_micro_batches=6), 1, 12, 6),
], ids=["default 1 stage", "default 3 stages", "micro-batch size", "explicit slots", "few slots", "explicit both"])
def test_batching_config_resolves_slots_and_micro_batches(config, stages, slots, micro_batches) -> None:
    resolved = config.resolved(stages)
    assert (resolved.num_slots, resolved.num_micro_batches) == (slots, micro_batches)
    assert resolved.resolved(stages) == resolved


@pytest.mark.parametrize("requests, expected", [
    pytest.param(10, [3, 3, 3, 1], id="fewer sequences than slots: each micro-batch takes its share"),
    pytest.param(40, [8, 8, 8, 8], id="more than the slots: every slot filled"),
    pytest.param(2, [1, 1, 0, 0], id="two sequences: two micro-batches in flight, not one"),
])
def test_a_small_job_is_spread_over_the_micro_batches(requests, expected) -> None:
    scheduler = Scheduler(BatchingConfig(num_slots=32, num_micro_batches=4), num_stages=3, eos_ids={0})
    for i in range(requests):
        scheduler.submit(GenerationRequest(f"r{i}", [5, 6, 7], max_new_tokens=4), now=0.0)
    sizes = []
    for mb in range(4):
        plan = scheduler.plan_step(mb, now=0.0)
        sizes.append(len(plan.rows) if plan else 0)
    assert sizes == expected


def test_at_the_tail_a_micro_batch_left_empty_takes_sequences_from_a_full_one() -> None:
    """Micro-batch 1's items end after one token while micro-batch 0's run on: without moves, micro-batch 0
    would carry both of its rows alone, leaving a 2-stage pipeline one step in flight."""
    scheduler = make(num_slots=4, micro_batches=2)
    stages = FakeStages()
    long_items = [request(f"long{i}", max_new_tokens=6, first=1 + i) for i in range(2)]
    short_items = [request(f"short{i}", max_new_tokens=1, first=5 + i) for i in range(2)]
    submit_all(scheduler, long_items + short_items)  # slots 0, 1 (micro-batch 0): long; 2, 3: short
    rows_per_step = []
    results = {}
    for i in range(40):
        if scheduler.idle:
            break
        plan, finished = step(scheduler, stages, i % 2, now=float(i))
        rows_per_step.append((i % 2, sorted(row.slot for row in plan.rows) if plan else []))
        results.update({r.request_id: r for r in finished})
    # Both micro-batches prefill two rows; the short items end at their first token; from then on each
    # micro-batch carries one long item (slot 1 moved to micro-batch 1; its cache stays in slot 1).
    assert rows_per_step[:2] == [(0, [0, 1]), (1, [2, 3])]
    assert rows_per_step[2:4] == [(0, [0]), (1, [1])]
    assert all(len(slots) == 1 for _, slots in rows_per_step[2:] if slots)
    for req in long_items + short_items:
        assert results[req.request_id].token_ids == reference(req, 2048)[0]


@pytest.mark.parametrize("late_item, rows", [
    pytest.param(False, 1, id="queue empty: two of micro-batch 0's three move"),
    pytest.param(True, 3, id="an item waiting: no move, the empty micro-batches admit instead"),
])
def test_tail_moves_wait_for_an_empty_queue(late_item: bool, rows: int) -> None:
    scheduler = make(num_slots=9, micro_batches=3)
    stages = FakeStages()
    submit_all(scheduler, [request(f"long{i}", max_new_tokens=8) for i in range(3)]
               + [request(f"short{i}", max_new_tokens=1) for i in range(5)])
    for mb in range(3):  # micro-batch 0 takes the long items, 1 and 2 the short ones, which end at once
        step(scheduler, stages, mb)
    assert len(scheduler.active) == 3
    if late_item:
        submit_all(scheduler, [request("late", max_new_tokens=8)])
    plan, _ = step(scheduler, stages, 0)
    assert len(plan.rows) == rows
    plans = [step(scheduler, stages, mb)[0] for mb in (1, 2)]
    rows_after = [len(plan.rows) if plan is not None else 0 for plan in plans]
    # Without the late item, micro-batches 1 and 2 decode one moved item each; with it, micro-batch 1
    # prefills the late item and 2 waits for micro-batch 0's next turn to hand it one.
    assert rows_after == ([1, 1] if not late_item else [1, 0])
