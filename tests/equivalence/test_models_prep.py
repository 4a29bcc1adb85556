"""The default model (SmolLM2-135M-Instruct): prepared from its GGUF once, reused after, and its answers sensible."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.models.default_model import (
    DEFAULT_MODEL_SOURCE,
    MARKER_NAME,
    default_model_dir,
    is_default_model_ready,
)


def test_default_model_is_prepared_and_reused(default_model, monkeypatch):
    config = json.loads((default_model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert json.loads((default_model / "generation_config.json").read_text())["eos_token_id"] == 2
    marker = json.loads((default_model / MARKER_NAME).read_text())
    assert marker["gguf_sha256"] == DEFAULT_MODEL_SOURCE.gguf_sha256
    assert is_default_model_ready()

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")

    # Reused: a later call returns the prepared directory and builds nothing.
    monkeypatch.setattr("layerbus.models.default_model._build_default_model",
                        lambda *args: pytest.fail("the prepared default model was built again"))
    assert default_model_dir() == default_model


def test_default_model_answers_sensibly(default_model):
    """The dequantized weights are right: a greedy answer to an easy question is correct."""
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model)
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    assert output[0, -1].item() == tokenizer.eos_token_id
