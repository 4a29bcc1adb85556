"""The direct computation lm-eval's HF backend is held to: one plain transformers forward pass, float32, over the
ids evals/encoding.py builds."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.evals.encoding import Encoder, model_input


@lru_cache(maxsize=4)
def transformers_model(model_dir: Path):
    """The same directory loaded by plain transformers, float32, for the direct computation."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def direct_logprobs(model, ids: list[int], n_scored: int) -> torch.Tensor:
    """log_softmax of the last n_scored positions of one forward pass over ids: [n_scored, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -n_scored:]
    return torch.log_softmax(logits.float(), dim=-1)


def direct_ids_loglikelihood(model, context_ids: list[int], continuation_ids: list[int], max_length: int):
    """(log-likelihood, is_greedy) of continuation_ids after context_ids, from the ids lm-eval's model runs on."""
    logprobs = direct_logprobs(model, model_input(context_ids, continuation_ids, max_length), len(continuation_ids))
    target = torch.tensor(continuation_ids)
    return logprobs.gather(1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())


def direct_loglikelihood(model, encoder: Encoder, context: str, continuation: str, max_length: int):
    return direct_ids_loglikelihood(model, *encoder.encode_pair(context, continuation), max_length)
