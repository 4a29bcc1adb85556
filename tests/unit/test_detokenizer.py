"""Incremental detokenization against the full decode, with the tiny test tokenizer: the text at every step and
at the end equals `decode(ids, skip_special_tokens=True)`, over random ids rich in split multi-byte characters
and special tokens; and the scheduler's stop strings, checked on the new text only, end sequences where the
old whole-output check did. tests/equivalence/test_detokenizer.py runs the same on the default model's tokenizer."""

from __future__ import annotations

import random

import pytest

from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig
from layerbus.broker.scheduler import Scheduler
from tests.helpers.tiny_models import make_tiny_tokenizer

# Text whose tokens split UTF-8 characters: accents, CJK, emoji (4 bytes), a combining mark.
MULTI_BYTE = "café naïve 東京 😀🎉 ñ e\u0301 — «ok» Ω≈ç √ 𝔘"


# The default model's tokenizer is the equivalence tier's (tests/equivalence/test_detokenizer.py runs the
# tests that take this fixture on it): preparing the model costs half a minute cold.
@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def random_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Ids drawn from: the tokens of multi-byte text, special tokens, and anything in the vocabulary."""
    pieces = tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    specials = list(tokenizer.all_special_ids)
    draws = [lambda: rng.choice(pieces), lambda: rng.choice(specials), lambda: rng.randrange(len(tokenizer))]
    return [rng.choice(draws)() for _ in range(length)]


def full_decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_text_equals_the_full_decode_at_every_step(tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(150):
        ids = random_ids(tokenizer, rng, rng.randrange(1, 30))
        detokenizer = IncrementalDetokenizer(tokenizer)
        for k, token in enumerate(ids, start=1):
            unchanged = detokenizer.add(token)
            expected = full_decode(tokenizer, ids[:k])
            assert detokenizer.visible == expected, ids[:k]
            assert detokenizer.visible_from(max(0, unchanged - 2)) == expected[max(0, unchanged - 2):]
            assert expected.startswith(detokenizer.text) and len(detokenizer.text) >= unchanged
        assert detokenizer.finish() == full_decode(tokenizer, ids), ids


def test_tokens_fed_in_runs_give_the_same_text(tokenizer) -> None:
    # The scheduler feeds a sequence without stop strings all at once at its end, and one that
    # found its stop string the rest of its tokens then: any split must give the full decode.
    rng = random.Random(1)
    for _ in range(150):
        ids = random_ids(tokenizer, rng, rng.randrange(1, 30))
        detokenizer = IncrementalDetokenizer(tokenizer)
        cut = rng.randrange(0, len(ids) + 1)
        for token in ids[:cut]:
            detokenizer.add(token)
        detokenizer.extend(ids[cut:])
        assert detokenizer.visible == full_decode(tokenizer, ids), (cut, ids)
        assert detokenizer.finish() == full_decode(tokenizer, ids), (cut, ids)


def test_the_tokens_of_real_text_come_back_exactly(tokenizer) -> None:
    ids = tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = []
    for token in ids:
        before = detokenizer.text
        detokenizer.add(token)
        emitted.append(detokenizer.text[len(before):])
        assert "\ufffd" not in detokenizer.text, "half a character is never emitted"
    # (== MULTI_BYTE up to the tiny tokenizer's NFC normalization of the combining accent)
    assert "".join(emitted) + detokenizer.tail == full_decode(tokenizer, ids) == detokenizer.finish()


def test_special_tokens_add_no_text() -> None:
    tokenizer = make_tiny_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.add(tokenizer.bos_token_id)
    assert (detokenizer.visible, detokenizer.finish()) == ("", "")
    for token in tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]:
        detokenizer.add(token)
    assert detokenizer.finish() == "hi"


def test_an_unfinished_character_ends_as_the_replacement_char() -> None:
    tokenizer = make_tiny_tokenizer()
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1, "the tiny vocabulary splits the emoji's bytes"
    detokenizer = IncrementalDetokenizer(tokenizer)
    for token in emoji[:-1]:
        detokenizer.add(token)
    assert detokenizer.text == "" and detokenizer.tail.endswith("\ufffd")
    assert detokenizer.finish() == full_decode(tokenizer, emoji[:-1])


def old_stop_check(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[int, int | None]:
    """What the scheduler did before: decode the whole output after every token. Returns the number
    of tokens generated and stop_text_end."""
    for k in range(1, len(ids) + 1):
        text = full_decode(tokenizer, ids[:k])
        hits = [text.find(stop) for stop in stops if stop and stop in text]
        if hits:
            return k, min(hits)
    return len(ids), None


def run_scheduler(tokenizer, ids: list[int], stops: tuple[str, ...]):
    """The scheduler with one slot, its "model" emitting `ids` in order."""
    config = BatchingConfig(num_slots=1, num_micro_batches=1, max_context=4096)
    scheduler = Scheduler(config, num_stages=1, eos_ids=set(), new_detokenizer=lambda: IncrementalDetokenizer(tokenizer))
    scheduler.submit(GenerationRequest("r", [1, 2, 3], max_new_tokens=len(ids), stop=stops), now=0.0)
    emitted = 0
    while True:
        plan = scheduler.plan_step(0, now=0.0)
        tokens = {row.slot: (ids[emitted], 0.0) for row in plan.rows if row.emit}
        emitted += len(tokens)
        finished = scheduler.apply_result(plan, tokens, now=0.0)
        if finished:
            return finished[0]


def test_stop_strings_end_where_the_whole_output_check_ended(tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(120):
        ids = random_ids(tokenizer, rng, rng.randrange(2, 25))
        text = full_decode(tokenizer, ids)
        stops = ["never there"]
        for _ in range(rng.randrange(1, 3)):
            if text:  # a piece of the output, often spanning tokens and multi-byte characters
                start = rng.randrange(len(text))
                stops.append(text[start:start + rng.randrange(1, 6)])
        stops = tuple(stops)
        length, stop_text_end = old_stop_check(tokenizer, ids, stops)
        result = run_scheduler(tokenizer, ids, stops)
        assert (len(result.token_ids), result.stop_text_end) == (length, stop_text_end), (ids, stops)
        assert result.finish_reason == ("stop" if stop_text_end is not None else "length")
        assert result.text == full_decode(tokenizer, ids[:length])[:stop_text_end]
