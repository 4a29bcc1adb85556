"""Model fingerprints: equal for the same files, different when a weight, the config or the tokenizer changes."""

from __future__ import annotations

import json
import shutil

from layerbus.models.fingerprint import cached_sha256, file_sha256, model_fingerprint


def test_fingerprint_follows_weights_config_and_tokenizer(tiny_models, tmp_path):
    original = tiny_models("llama")
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    base = model_fingerprint(original)
    assert model_fingerprint(copy) == base, "a copy is the same model"
    assert base["weights"] and all(len(h) == 64 for h in base["weights"].values())

    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    changed = model_fingerprint(copy)
    assert changed["weights"] != base["weights"] and changed["config"] == base["config"]

    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy)["config"] != base["config"]

    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + " ")
    assert model_fingerprint(copy)["tokenizer"] != base["tokenizer"]


def test_the_hash_cache_notices_a_rewritten_file(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"one")
    first = cached_sha256(path)
    assert first == file_sha256(path)
    path.write_bytes(b"two!")  # a different size: a different cache key even within one mtime tick
    assert cached_sha256(path) == file_sha256(path) != first
