"""Fixtures the CLI tests share: the tiny llama's directory and a LAYERBUS_HOME for the CLI's processes.

Imported by name into the modules that use them (`from tests.helpers.fixtures_cli import home, tiny`). `model`
is the tiny llama too, module-scoped, for the modules whose reference run is a module fixture."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def tiny(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture(scope="module")
def model(tiny_models) -> Path:
    return tiny_models("llama")
