"""Next-token choice: greedy is argmax, sampling is a pure function of (logits, params, seed,
position), and the sampled distribution is the tempered, truncated softmax."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from layerbus.stages.sampling import choose_token, target_log_probs
from layerbus.wire.sampling import SamplingParams


def random_logits(seed: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"logits{s}")
def test_greedy_is_argmax_with_its_log_prob(seed: int) -> None:
    logits = random_logits(seed)
    token, logprob = choose_token(logits, SamplingParams(), position=seed)
    assert token == int(logits.argmax())
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-6)


def test_greedy_ignores_seed_and_position() -> None:
    logits = random_logits(7)
    assert {choose_token(logits, SamplingParams(seed=s), position=p)[0] for s in range(3) for p in range(20)} == {
        int(logits.argmax())}


def test_same_seed_and_position_give_the_same_token() -> None:
    logits = torch.zeros(1000)  # uniform: every draw is pure randomness
    params = SamplingParams(temperature=1.0, seed=42)
    for position in range(50):
        assert choose_token(logits, params, position) == choose_token(logits.clone(), params, position)


def test_draws_depend_on_seed_and_position() -> None:
    logits = torch.zeros(1000)
    by_seed = {seed: [choose_token(logits, SamplingParams(temperature=1.0, seed=seed), p)[0] for p in range(100)]
               for seed in (0, 1, 2)}
    # 100 uniform draws over 1000 tokens: equal sequences, or many coincidences, mean shared randomness
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert sum(x == y for x, y in zip(by_seed[a], by_seed[b])) < 10
    assert len(set(by_seed[0])) > 80  # positions are not all the same draw


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"logits{s}")
def test_top_k_one_equals_greedy(seed: int) -> None:
    logits = random_logits(seed)
    for position in range(20):
        params = SamplingParams(temperature=2.0, top_k=1, seed=position)
        assert choose_token(logits, params, position)[0] == int(logits.argmax())


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"logits{s}")
def test_tiny_top_p_equals_greedy(seed: int) -> None:
    logits = random_logits(seed)
    for position in range(20):
        params = SamplingParams(temperature=1.5, top_p=1e-6, seed=position)
        assert choose_token(logits, params, position)[0] == int(logits.argmax())


def test_top_k_keeps_only_the_k_most_likely() -> None:
    logits = random_logits(3, vocab=20)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    drawn = {choose_token(logits, SamplingParams(temperature=5.0, top_k=3, seed=1), p)[0] for p in range(300)}
    assert drawn == top3


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = {choose_token(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=9), p)[0] for p in range(400)}
    assert drawn == {0, 1}  # 0.5 < 0.75 needs the second token; 0.8 reaches it
    drawn = {choose_token(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=9), p)[0] for p in range(400)}
    assert drawn == {0, 1, 2}


def chi_square(counts: Counter, probs: list[float], draws: int) -> float:
    return sum((counts[i] - draws * p) ** 2 / (draws * p) for i, p in enumerate(probs))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0], ids=lambda t: f"T={t}")
def test_sampled_frequencies_follow_the_tempered_softmax(temperature: float) -> None:
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    probs = torch.softmax(logits / temperature, dim=-1).tolist()
    draws = 5000
    params = SamplingParams(temperature=temperature, seed=1234)
    counts = Counter(choose_token(logits, params, position)[0] for position in range(draws))
    # 3 degrees of freedom: P(chi2 > 16.27) = 0.001; the draws are deterministic, so this never flakes
    assert chi_square(counts, probs, draws) < 16.27, (counts, probs)
    # and the statistic is able to tell the temperatures apart
    other = torch.softmax(logits / (temperature * 2), dim=-1).tolist()
    assert chi_square(counts, other, draws) > 16.27


def test_sampled_token_reports_the_untempered_log_prob() -> None:
    logits = random_logits(11, vocab=10)
    token, logprob = choose_token(logits, SamplingParams(temperature=0.7, seed=3), position=5)
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-6)


def test_target_log_probs_gather_the_log_softmax() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(0)) * 4
    targets = [3, 0, 29, 3, 17, 8]
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(6), torch.tensor(targets)]
    got, greedy = target_log_probs(logits, targets)
    assert got == pytest.approx(expected.tolist(), abs=1e-6)
    assert all(value <= 0 for value in got)
    assert greedy == (logits.argmax(-1) == torch.tensor(targets)).tolist()
    assert target_log_probs(torch.zeros(2, 4), [1, 2])[0] == pytest.approx([math.log(0.25)] * 2)


def test_target_is_greedy_exactly_when_it_is_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.5, 0.1], [0.0, 0.0, 9.0]])
    assert target_log_probs(logits, [1, 1, 2])[1] == [True, False, True]


@pytest.mark.parametrize("fields, message", [
    ({"temperature": -0.1}, r"temperature must be >= 0, got -0.1"),
    ({"top_k": -1}, r"top_k must be >= 0, got -1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_p": -0.5}, r"top_p must be in \(0, 1\], got -0.5"),
    ({"top_p": float("nan")}, r"top_p must be in \(0, 1\], got nan"),
    ({"temperature": float("nan")}, r"temperature"),
], ids=["negative temperature", "negative top_k", "zero top_p", "top_p above 1", "negative top_p", "nan top_p",
        "nan temperature"])
def test_invalid_params_raise(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


PARAMS = {
    "greedy": SamplingParams(),
    "greedy with a seed": SamplingParams(seed=5),
    "sampled": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=123456789),
    "temperature only": SamplingParams(temperature=1.0),
}


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_params_round_trip_through_json(params: SamplingParams) -> None:
    encoded = params.to_json()
    decoded = SamplingParams.from_json(encoded)
    if params.greedy:
        assert encoded == {} and decoded.greedy
    else:
        assert decoded == params


def _allow_only(tokens: set[int], vocab: int) -> str:
    from layerbus.wire.constraint import pack_mask

    bits = bytearray((vocab + 7) // 8)
    for token in tokens:
        bits[token // 8] |= 1 << (token % 8)
    return pack_mask(bytes(bits))


def test_a_step_mixing_greedy_sampled_masked_and_top_logprob_rows_picks_each_row_as_alone() -> None:
    """last_stage_outputs picks plain greedy rows together (one argmax where the logits are) and the others
    one by one: every row must still get what choose_token gives for its own logits alone."""
    from types import SimpleNamespace

    from layerbus.stages.sampling import last_stage_outputs
    from layerbus.wire.constraint import MASK_KEY
    from layerbus.wire.protocol import StepRow
    from layerbus.wire.sampling import TOP_LOGPROBS_KEY

    vocab, hidden_size = 40, 8
    generator = torch.Generator().manual_seed(7)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=generator) * 2)
    shard = SimpleNamespace(lm_head=head, config=SimpleNamespace())
    sampled = SamplingParams(temperature=1.5, seed=11).to_json()
    rows = [
        StepRow(0, 5, 1, emit=True),  # plain greedy
        StepRow(1, 3, 2, emit=True, sampling=sampled),  # a 2-token chunk, sampled: its last position emits
        StepRow(2, 9, 1, emit=True, sampling={MASK_KEY: _allow_only({3, 17}, vocab)}),  # greedy under a grammar
        StepRow(3, 4, 1, emit=True, sampling={TOP_LOGPROBS_KEY: 3}),  # greedy with top logprobs
        StepRow(4, 0, 3, emit=False),  # a prefill chunk that emits nothing
        StepRow(5, 7, 1, emit=True),  # plain greedy again, after the others
    ]
    hidden = torch.randn(sum(row.length for row in rows), hidden_size, generator=generator)
    tokens = {entry[0]: entry[1:] for entry in last_stage_outputs(shard, rows, hidden)["tokens"]}

    assert sorted(tokens) == [0, 1, 2, 3, 5], "one token per emitting row, none for the silent chunk"
    with torch.no_grad():
        logits = head(hidden).float()
    ends = {0: 0, 1: 2, 2: 3, 3: 4, 5: 8}  # each emitting row's last packed position
    for slot, position in ends.items():
        row = next(r for r in rows if r.slot == slot)
        row_logits = logits[position]
        log_probs = torch.log_softmax(row_logits, dim=-1)
        if MASK_KEY in row.sampling:
            allowed = torch.zeros(vocab, dtype=torch.bool)
            allowed[[3, 17]] = True
            row_logits = row_logits.masked_fill(~allowed, float("-inf"))
        want, want_logprob = choose_token(row_logits, SamplingParams.from_json(row.sampling), row.start + row.length,
                                          log_probs)
        assert tokens[slot][0] == want, f"slot {slot}"
        assert tokens[slot][1] == pytest.approx(want_logprob, abs=1e-5), f"slot {slot}"
    assert tokens[2][0] in {3, 17}, "the grammar's mask holds"
    top = tokens[3][2]
    assert [token for token, _ in top] == torch.topk(torch.log_softmax(logits[4], -1), 3).indices.tolist()
    assert top[0][0] == tokens[3][0], "greedy: the chosen token is the most likely one"
