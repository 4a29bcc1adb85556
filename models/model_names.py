"""The names a model directory answers to, and finding a model by the name a batch line gives.

An OpenAI batch line names its model (`body.model`); a job runs exactly one. A line names the job's
model when it gives the directory's path, the directory's name, or the name the model was prepared
or imported under (its marker file, models.default_model.MARKER_NAME). Anything else is another
model, and answering it with this one would hand a user the wrong model's output without a word.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from layerbus.models.default_model import DEFAULT_MODEL_NAME, MARKER_NAME, model_cache_dir


def names_of(model_dir: Path, given: str | None = None) -> frozenset[str]:
    """Every name `model_dir` answers to; `given`: what the user typed for --model, if anything."""
    names = {str(model_dir), model_dir.name}
    if given:
        names.add(given)
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text())
        if isinstance(marker, dict) and isinstance(marker.get("name"), str):
            names.add(marker["name"])
    except (OSError, ValueError):
        pass  # not prepared by layerbus: its path and directory name are its names
    return frozenset(names)


def find_named_model(name: str, progress: Callable[[str], None] = print) -> Path | None:
    """The model directory `name` refers to: a directory with a config.json at that path, or a model
    prepared or imported under that name in the model cache; None when neither exists. The default
    model's name counts even before it is prepared (naming it prepares it, as omitting --model does)."""
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.absolute()
    if "/" in name or name in (".", ".."):
        return None
    prepared = model_cache_dir() / name
    if (prepared / MARKER_NAME).is_file():
        return prepared
    if name == DEFAULT_MODEL_NAME:
        from layerbus.models.default_model import default_model_dir

        return default_model_dir(progress=progress)
    return None
