"""lm-eval's HF backend as it runs for users (tests/helpers/lm_eval_reference.py) scores the default model as a
plain transformers forward pass does (tests/helpers/direct_scores.py). tests/unit/test_lm_eval_reference.py
holds the tiny models to the same, for every request type."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from layerbus.evals.encoding import Encoder  # noqa: E402
from tests.helpers.direct_scores import direct_loglikelihood, transformers_model  # noqa: E402
from tests.helpers.lm_eval_reference import hf_lm, hf_loglikelihood  # noqa: E402


def test_the_default_model_loglikelihood_equals_a_direct_forward_pass(default_model):
    max_length = 2048
    model, tokenizer = transformers_model(default_model)
    encoder = Encoder(tokenizer)
    pairs = [("Question: What is the capital of France?\nAnswer:", " Paris"), ("", "Hello there."),
             ("The sea is wide and ", "grey")]
    theirs = hf_loglikelihood(hf_lm(default_model, max_length, 2), pairs)
    for pair, (ll, greedy) in zip(pairs, theirs):
        expected_ll, expected_greedy = direct_loglikelihood(model, encoder, *pair, max_length)
        assert ll == pytest.approx(expected_ll, abs=1e-3), pair
        assert greedy == expected_greedy, pair
