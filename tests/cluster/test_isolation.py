"""The test suite's own hygiene (tests/conftest.py), with a real CLI process: `layerbus submit` under the test's
LAYERBUS_HOME creates nothing in the user's home folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from layerbus.storage.locations import layerbus_home
from tests.helpers.cli import REPO, layerbus_executable, write_jsonl


def test_a_cli_command_creates_nothing_in_the_users_home(tmp_path: Path, tiny_models) -> None:
    fake_home = tmp_path / "user-home"
    fake_home.mkdir()
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": "a", "text": "Nothing lands in the home folder."}])
    env = {**os.environ, "HOME": str(fake_home), "TQDM_DISABLE": "1"}  # LAYERBUS_HOME as the fixture set it
    done = subprocess.run([layerbus_executable(), "submit", str(corpus), "--task", "summarize", "--model",
                           str(tiny_models("llama"))], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (layerbus_home() / "layerbus.db").is_file()
    assert sorted(str(p.relative_to(fake_home)) for p in fake_home.rglob("*")) == []
