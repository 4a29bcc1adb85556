"""Where layerbus keeps its files by default; the standard library only, so light commands
(`layerbus status`) can find the store without importing a database toolkit."""

from __future__ import annotations

import os
from pathlib import Path


def layerbus_home() -> Path:
    """$LAYERBUS_HOME (default ~/.local/share/layerbus), created if missing."""
    home = Path(os.environ.get("LAYERBUS_HOME") or Path.home() / ".local" / "share" / "layerbus")
    home.mkdir(parents=True, exist_ok=True)
    return home


def default_db_url() -> str:
    """The SQLite store used when no --db is given: $LAYERBUS_HOME/layerbus.db."""
    return f"sqlite:///{layerbus_home() / 'layerbus.db'}"


def default_results_dir() -> Path:
    """Where final Parquet files go when no results folder is given: $LAYERBUS_HOME/results."""
    path = layerbus_home() / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path
