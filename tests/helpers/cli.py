"""Helpers for the CLI tests: the `layerbus` console script run as users do, a subprocess with its own
LAYERBUS_HOME."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOB_ID = re.compile(r"job_[0-9a-f]{12}")


def layerbus_executable() -> str:
    beside_python = Path(sys.executable).parent / "layerbus"
    found = str(beside_python) if beside_python.exists() else shutil.which("layerbus")
    if found is None:
        raise RuntimeError("no layerbus console script: `pip install -e .` in this environment")
    return found


def cli_env(home: Path) -> dict[str, str]:
    """The environment for a CLI process: its own LAYERBUS_HOME, so nothing touches ~/.local."""
    return {**os.environ, "LAYERBUS_HOME": str(home), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}


def layerbus(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([layerbus_executable(), *map(str, args)], env=cli_env(home), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def status_json(home: Path, *args: str) -> dict | list:
    result = layerbus(home, "status", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def write_jsonl(path: Path, items: list[dict | str]) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return path
