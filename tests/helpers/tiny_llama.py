"""A tiny llama built from a config, for the KV cache and replay tests that compare a stage with the model
run whole: its size, random prompts within its vocabulary, and the tolerance of the comparison."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ATOL = 1e-4
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=100, max_position_embeddings=128,
            initializer_range=0.1)  # larger than the default so attention is far from uniform


def save_tiny_model(config, path: Path, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)  # transformers 5 always writes safetensors
    assert (path / "model.safetensors").is_file()
    return model


def tokens(seed: int, length: int) -> list[int]:
    return torch.randint(0, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
