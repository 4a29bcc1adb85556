"""Where the job store and results live by default; the standard library only, so light commands
(`layerbus status`) can find the store without importing a database toolkit."""

from __future__ import annotations

from pathlib import Path

from layerbus.models.home import layerbus_home


def default_db_url() -> str:
    """The SQLite store used when no --db is given: $LAYERBUS_HOME/layerbus.db."""
    return f"sqlite:///{layerbus_home() / 'layerbus.db'}"


def default_results_dir() -> Path:
    """Where final Parquet files go when no results folder is given: $LAYERBUS_HOME/results."""
    path = layerbus_home() / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path
