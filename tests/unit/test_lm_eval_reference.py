"""tests/helpers/lm_eval_reference.py runs lm-eval's HF backend as it runs for users: its numbers equal a plain
transformers forward pass over the ids evals/encoding.py builds (tests/helpers/direct_scores.py), on tiny
models. tests/equivalence/test_lm_eval_reference.py holds the default model to the same."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
import torch  # noqa: E402

from layerbus.evals.encoding import Encoder  # noqa: E402
from tests.helpers.direct_scores import (  # noqa: E402
    direct_ids_loglikelihood,
    direct_loglikelihood,
    direct_logprobs,
    transformers_model,
)
from tests.helpers.lm_eval_reference import (  # noqa: E402
    MC_YAML,
    hf_generate_until,
    hf_lm,
    hf_loglikelihood,
    hf_loglikelihood_rolling,
    hf_simple_evaluate,
)
from tests.helpers.tiny_models import BOS, single_torch_thread  # noqa: E402

WORDS = ["the", " stage", " layer", " ", "  ", "\n", ".", ",", "?", " 42", "é", "日本", " spider", " legs", BOS]


def random_text(rng: random.Random, max_pieces: int) -> str:
    """Some words; never only whitespace (lm-eval's HF backend fails an assertion on a blank context)."""
    while not (text := "".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_pieces)))).strip():
        pass
    return text


@pytest.fixture(scope="module")
def llama(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.mark.parametrize("batch_size", [1, 5])
def test_loglikelihood_equals_a_direct_forward_pass(llama, batch_size):
    max_length = 16
    model, tokenizer = transformers_model(llama)
    encoder = Encoder(tokenizer)
    rng = random.Random(batch_size)
    pairs = [("" if i % 6 == 0 else random_text(rng, 12) + rng.choice(["", " ", "\n"]), random_text(rng, 3))
             for i in range(24)]
    # Continuations the model predicts greedily (the argmax token after the context), so is_greedy is sometimes true;
    # some share a context with one-token siblings, which lm-eval scores from one cached forward pass.
    for context in ["The stage receives", "A spider has eight", "Paris is the capital of"]:
        ids = encoder.tok_encode(context)
        best = direct_logprobs(model, ids, 1)[0].argmax().item()
        pairs += [(context, tokenizer.decode([best])), (context, tokenizer.decode([(best + 1) % len(tokenizer)]))]
    with single_torch_thread():
        theirs = hf_loglikelihood(hf_lm(llama, max_length, batch_size), pairs)
        ours = [direct_loglikelihood(model, encoder, c, x, max_length) for c, x in pairs]
    assert len(theirs) == len(pairs)
    for pair, (ll, greedy), (expected_ll, expected_greedy) in zip(pairs, theirs, ours):
        assert ll == pytest.approx(expected_ll, abs=1e-4), pair
        assert greedy == expected_greedy, pair
    assert any(greedy for _, greedy in theirs), "no greedy continuation: is_greedy was never exercised"
    assert sum(len(sum(encoder.encode_pair(*p), [])) > max_length + 1 for p in pairs) >= 5, "too few truncated"


def test_rolling_loglikelihood_is_the_sum_over_encoders_windows(llama):
    max_length = 8
    model, tokenizer = transformers_model(llama)
    encoder = Encoder(tokenizer)
    rng = random.Random(7)
    texts = ["x", "The stage receives a batch of hidden states, runs its layers, and sends the result on."]
    texts += [random_text(rng, 30) for _ in range(6)]
    with single_torch_thread():
        theirs = hf_loglikelihood_rolling(hf_lm(llama, max_length, 3), texts)
        for text, ll in zip(texts, theirs):
            windows = encoder.rolling_windows(text, max_length)
            expected = sum(direct_ids_loglikelihood(model, context, predicted, max_length)[0]
                           for context, predicted in windows)
            assert ll == pytest.approx(expected, abs=1e-4), text
    assert max(len(encoder.rolling_windows(t, max_length)) for t in texts) >= 4


def direct_greedy_text(model, tokenizer, context: str, until: list[str], max_gen_toks: int, max_length: int) -> str:
    """Greedy decoding as lm-eval's generate_until does it, one sequence at a time: the context left-truncated to
    max_length - max_gen_toks tokens, stop at EOS or after max_gen_toks, special tokens dropped, cut at `until`."""
    ids = tokenizer.encode(context, add_special_tokens=not context.startswith(tokenizer.bos_token))
    ids = ids[-(max_length - max_gen_toks):]
    generated: list[int] = []
    while len(generated) < max_gen_toks:
        token = direct_logprobs(model, ids + generated, 1)[0].argmax().item()
        if token == tokenizer.eos_token_id:
            break
        generated.append(token)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    for stop in until:
        text = text.split(stop)[0]
    return text


def test_generate_until_equals_direct_greedy_decoding(llama):
    max_length = 24
    model, tokenizer = transformers_model(llama)
    rng = random.Random(11)
    # Stop strings the random model does emit ("re", " a", "s"), so some texts are cut; contexts over 24 - 9 tokens
    # are truncated on the left; the tiny model's EOS ends about half of the generations.
    stops = [["\n"], [".", "?"], [], ["re", "s"], [" a"]]
    requests = [(random_text(rng, 14), {"until": rng.choice(stops), "max_gen_toks": rng.choice([4, 9]), "do_sample": False})
                for _ in range(12)]
    with single_torch_thread():
        theirs = hf_generate_until(hf_lm(llama, max_length, 1), requests)
        ours = [direct_greedy_text(model, tokenizer, context, kwargs["until"], kwargs["max_gen_toks"], max_length)
                for context, kwargs in requests]
        uncut = [direct_greedy_text(model, tokenizer, context, [], kwargs["max_gen_toks"], max_length)
                 for context, kwargs in requests]
    assert theirs == ours
    assert any(a != b for a, b in zip(ours, uncut)), "no stop string was met"


MC_ROWS = [{"question": f"What is {i} plus {i}?", "choices": [str(2 * i), str(2 * i + 1), "a spider"], "gold": i % 3}
           for i in range(9)]


def test_simple_evaluate_on_a_local_task_scores_with_the_same_loglikelihoods(llama, tmp_path):
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in MC_ROWS))
    (tmp_path / "sums.yaml").write_text(MC_YAML)
    max_length = 32
    with single_torch_thread():
        results = hf_simple_evaluate(llama, tmp_path / "sums.yaml", max_length=max_length, bootstrap_iters=0)
        lls = hf_loglikelihood(hf_lm(llama, max_length), [
            (f"Question: {row['question']}\nAnswer:", f" {choice}") for row in MC_ROWS for choice in row["choices"]])
    scores = [[ll for ll, _ in lls[3 * i: 3 * i + 3]] for i in range(len(MC_ROWS))]
    acc = sum(max(range(3), key=s.__getitem__) == row["gold"] for s, row in zip(scores, MC_ROWS)) / len(MC_ROWS)
    norm = [[ll / len(f" {c}".encode()) for ll, c in zip(s, row["choices"])] for s, row in zip(scores, MC_ROWS)]
    acc_norm = sum(max(range(3), key=n.__getitem__) == row["gold"] for n, row in zip(norm, MC_ROWS)) / len(MC_ROWS)
    entry = results["results"]["tiny_sums"]
    assert results["n-samples"]["tiny_sums"] == {"original": len(MC_ROWS), "effective": len(MC_ROWS)}
    assert (entry["acc,none"], entry["acc_norm,none"]) == pytest.approx((acc, acc_norm))
    assert results["config"]["model_dtype"] == torch.float32 and results["max_length"] == max_length
