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
