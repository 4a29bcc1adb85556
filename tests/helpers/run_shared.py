"""What the xdist workers of one test run share: a folder of the run's own, things built or computed
once per run in it (tiny models, references from transformers), under a file lock."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def run_shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder for this test run, shared by its xdist workers (their base folders' common parent is the
    run's own, so nothing carries over between runs); without xdist, one of this session's."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return tmp_path_factory.mktemp(name, numbered=False)
    shared = tmp_path_factory.getbasetemp().parent / name
    shared.mkdir(exist_ok=True)
    return shared


def built_once(root: Path, name: str, build: Callable[[Path], Path]) -> Path:
    """root/name, built by the first worker to ask (into a scratch folder, renamed whole, under a lock)."""
    target = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            scratch = root / f"{name}.{os.getpid()}.building"
            shutil.rmtree(scratch, ignore_errors=True)
            build(scratch)
            os.replace(scratch, target)
    return target


def computed_once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], Any]) -> Any:
    """`compute()` once per test run, not once per xdist worker: the first worker to ask computes it
    holding a lock and leaves it as JSON in the run's shared folder; the others wait and read it. For
    what only depends on the checkout (references from transformers), never on a test's own state."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    path = run_shared_dir(tmp_path_factory, "computed-once") / f"{name}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if compute() raises
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(value))
        os.replace(temporary, path)
        return value
