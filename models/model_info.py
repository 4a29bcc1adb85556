"""What the broker needs to know about the model without loading any weight: layer count, costs,
end-of-sequence ids, context limit and the tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from layerbus.models.model_files import ModelFiles, open_model_dir


@dataclass(frozen=True)
class ModelInfo:
    files: ModelFiles  # the validated model directory
    eos_ids: frozenset[int]  # generation ends at any of these
    max_positions: int  # the model's own context limit

    @property
    def path(self) -> Path:
        return self.files.path


def read_model_info(model_dir: str | Path) -> ModelInfo:
    files = open_model_dir(model_dir)
    return ModelInfo(files=files, eos_ids=frozenset(_eos_ids(files)),
                     max_positions=int(getattr(files.config, "max_position_embeddings", 2048) or 2048))


def _eos_ids(files: ModelFiles) -> set[int]:
    # generate() stops at generation_config's eos ids; fall back to the model config's.
    ids: set[int] = set()
    generation_config = files.path / "generation_config.json"
    if generation_config.is_file():
        ids |= _as_set(json.loads(generation_config.read_text()).get("eos_token_id"))
    if not ids:
        ids |= _as_set(getattr(files.config, "eos_token_id", None))
    return ids


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer  # imported late: a second or two the stage processes never need

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as error:  # transformers raises OSError/ValueError/... for a missing tokenizer
        raise ValueError(f"{model_dir}: no usable tokenizer ({error}); the model directory needs "
                         "tokenizer.json or the files of a transformers tokenizer") from None
