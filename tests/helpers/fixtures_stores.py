"""The job store on both back ends: `store_url` is a fresh SQLite file, then a fresh PostgreSQL database
(marked `postgres`: the suite's throwaway server), and `store` the store opened on it.

Imported by name into the modules whose tests must hold on both (`from tests.helpers.fixtures_stores import store,
store_url`), since other modules define a `store` of their own, on SQLite only."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerbus.storage import JobStore


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres_fresh_url")


@pytest.fixture
def store(store_url: str):
    with JobStore.open(store_url) as opened:
        yield opened
