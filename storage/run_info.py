"""What a run of a job looked like on the cluster (the codec of each link between stages, the
layer spans), kept beside the store as one small JSON file per job so `layerbus status` can show it.

The standard library only: `layerbus status` reads it without importing a database toolkit. The
file lives under $LAYERBUS_HOME of the machine that ran the broker; status on another machine
(a shared PostgreSQL store) shows no wire line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from layerbus.storage.locations import layerbus_home


def run_info_path(job_id: str, home: Path | None = None) -> Path:
    return (home or layerbus_home()) / "runs" / f"{job_id}.json"


def write_run_info(job_id: str, info: dict[str, Any], home: Path | None = None) -> Path:
    """Replace the job's run info atomically (the latest run wins)."""
    path = run_info_path(job_id, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(info, indent=1))
    os.replace(partial, path)
    return path


def read_run_info(job_id: str, home: Path | None = None) -> dict[str, Any] | None:
    """The job's last run info, or None when this machine ran no broker for it (or the file is unreadable)."""
    try:
        info = json.loads(run_info_path(job_id, home).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def chain_line(info: dict[str, Any] | None) -> str | None:
    """The run's chain in its one text form (wire.spans.format_chain), e.g.
    "stage-0 [0, 3) -int8-> stage-1 [3, 6)", or None without run info."""
    info = info or {}
    stages, links = info.get("stages"), info.get("wire")
    if not (isinstance(stages, list) and stages) and not (isinstance(links, list) and links):
        return None
    # Here, not at the top: `layerbus status` of a job never run on this machine has no chain to format.
    from layerbus.wire.spans import format_chain

    try:
        if isinstance(stages, list) and stages:
            codecs = [link["codec"] for link in links] if isinstance(links, list) else []
            return format_chain([s["name"] for s in stages], [s["layers"] for s in stages], codecs)
        if isinstance(links, list) and links:  # an older file without the stages
            return format_chain([links[0]["from"], *(link["to"] for link in links)], None,
                                [link["codec"] for link in links])
    except (KeyError, TypeError, ValueError):
        pass
    return None
