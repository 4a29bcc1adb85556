"""A model directory's fingerprint: what must be equal for two eval runs to have scored the same model.

lm-evaluation-harness keys its caches by model name, so two checkpoints under one name mix (its issues
#2715, #4063). Ours hashes what the numbers depend on: the config, every weight file's bytes, the
tokenizer files and the chat template. Hashing weights reads every byte once; the digest is cached
under $LAYERBUS_HOME keyed by (path, size, mtime), so a nightly run over an unchanged model costs a
stat per file. Standard library only: no torch, no transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from layerbus.models.home import layerbus_home

# Files that decide how text becomes token ids (and back), whichever of them the model has.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_path() -> Path:
    return layerbus_home() / "cache" / "file-hashes.json"


def cached_sha256(path: Path) -> str:
    """sha256 of a file, remembered by (resolved path, size, mtime_ns) across runs."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    cache_file = _cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}  # missing or damaged: start over, it is only a cache
    if key not in cache:
        cache[key] = file_sha256(path)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        temporary = cache_file.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(cache, indent=0, sort_keys=True))
        temporary.replace(cache_file)  # atomic: a concurrent run reads the old cache or the new one
    return cache[key]


def model_fingerprint(model_dir: str | Path) -> dict:
    """{config, weights: {file: sha256}, tokenizer: {file: sha256}, chat_template} of a model directory."""
    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    tokenizer_files = {name: cached_sha256(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()}
    template = None
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        pass
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    return {
        "config": canonical_hash(config),
        "weights": {p.name: cached_sha256(p) for p in sorted(folder.glob("*.safetensors"))},
        "tokenizer": canonical_hash(tokenizer_files),
        "chat_template": hashlib.sha256(str(template).encode()).hexdigest() if template is not None else None,
    }


def canonical_hash(value: object) -> str:
    """sha256 of a JSON value written canonically (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
