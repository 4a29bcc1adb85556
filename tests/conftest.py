"""Shared pytest configuration: each fixture family lives in its own module, named here."""

pytest_plugins = [
    "tests.fixtures_models",
    "tests.fixtures_postgres",
]
