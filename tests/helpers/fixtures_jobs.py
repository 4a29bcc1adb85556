"""Fixtures the job tests share: the tiny llama's tokenizer and a fresh SQLite job store.

Imported by name into the modules that use them (`from tests.helpers.fixtures_jobs import store, tokenizer`),
since other modules define their own `store` with other meanings."""

from __future__ import annotations

import pytest

from layerbus.models.model_info import load_tokenizer
from layerbus.storage import JobStore


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return load_tokenizer(tiny_models("llama"))


@pytest.fixture
def store(tmp_path):
    with JobStore.open(f"sqlite:///{tmp_path / 'jobs.db'}") as opened:
        yield opened
