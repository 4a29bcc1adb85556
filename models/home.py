"""Where layerbus keeps its files: $LAYERBUS_HOME, default ~/.local/share/layerbus.

The standard library only, and in the lowest package that needs it (the default model's cache), so
the job store, the broker and the stages all find the same folder without importing one another.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def home_path(environ: Mapping[str, str] = os.environ) -> Path:
    """$LAYERBUS_HOME, default ~/.local/share/layerbus; not created."""
    return Path(environ.get("LAYERBUS_HOME") or "~/.local/share/layerbus").expanduser()


def layerbus_home() -> Path:
    """$LAYERBUS_HOME (default ~/.local/share/layerbus), created if missing."""
    home = home_path()
    home.mkdir(parents=True, exist_ok=True)
    return home


def profile_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where measurements of stages are cached (a stage's profile, the broker's co-run factors):
    $LAYERBUS_PROFILE_CACHE, else $LAYERBUS_HOME/profiles; not created. The variable lets stages whose
    homes differ share measurements (machines on one file system, a test session); every entry is
    keyed by what it depends on, so sharing never mixes devices, models, dtypes or thread counts."""
    given = environ.get("LAYERBUS_PROFILE_CACHE")
    return Path(given).expanduser() if given else home_path(environ) / "profiles"
