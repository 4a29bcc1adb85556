"""Model preparation from two processes at once: one builds the model, the other waits on the lock and reuses it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_prepare_once_in_two_processes_builds_once(tmp_path):
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from layerbus.models.default_model import prepare_once

        def build(staging):
            with open({str(tmp_path / "log")!r}, "a") as f:
                f.write("built\\n")
            time.sleep(1.0)  # long enough for the other process to reach the lock
            staging.mkdir()
            return {{}}

        print(prepare_once(Path({str(tmp_path / "cache" / "m")!r}), build, progress=lambda _: None))
        """
    )
    root = Path(__file__).resolve().parents[2]
    processes = [
        subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60)[0].strip() for p in processes]
    assert [p.returncode for p in processes] == [0, 0]
    assert outputs == [str(tmp_path / "cache" / "m")] * 2
    assert (tmp_path / "log").read_text() == "built\n"
