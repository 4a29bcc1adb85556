"""`layerbus top --once` on a SQLite store written by the test: the running job's stages, a finished job, the
errors, and a command light enough to leave running. tests/cluster/test_top_cli.py reads a PostgreSQL store, a
real 2-stage run, and the interactive view on a real terminal (tmux)."""

from __future__ import annotations

import json
import subprocess
import sys

from layerbus.cli.main import main
from layerbus.storage.store import JobStore
from tests.helpers.cli import REPO
from tests.helpers.stage_snapshots import BROKER, running_store


def test_once_prints_the_running_jobs_stages(tmp_path, capsys):
    url, job_id = running_store(tmp_path)

    assert main(["top", "--once", "--db", url]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"layerbus top  {job_id} (demo)  in_progress")
    assert lines[4].startswith(f"broker {BROKER}  snapshot ")
    assert [line.split()[:4] for line in lines[6:]] == [["stage-0", "box-a", "[0,", "2)"],
                                                         ["stage-1", "box-a", "[2,", "4)"]]
    assert all(" 93% " in line for line in lines[6:])


def test_a_finished_job_is_shown_and_frames_end_with_it(tmp_path, capsys):
    url, job_id = running_store(tmp_path)
    with JobStore.open(url) as store:
        failed = store.latest_job_id("failed")
    assert main(["top", failed, "--once", "--db", url]) == 0
    out = capsys.readouterr().out
    assert f"{failed} (demo)  failed" in out and "no stage snapshots" in out
    # Not on a terminal: a frame per refresh until the job has ended, exit 1 as it did not complete.
    assert main(["top", failed, "--db", url, "--interval", "0.01"]) == 1
    assert capsys.readouterr().out.count("layerbus top  ") == 1


def test_errors_name_the_job_or_the_empty_store(tmp_path, capsys):
    url, _ = running_store(tmp_path)
    assert main(["top", "job_000000000000", "--once", "--db", url]) == 2
    assert "no job 'job_000000000000'" in capsys.readouterr().err
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    JobStore.open(empty).close()
    assert main(["top", "--once", "--db", empty]) == 2
    err = capsys.readouterr().err
    assert "no jobs in" in err and "layerbus submit" in err


def test_top_stays_light(tmp_path):
    """`layerbus top` is left running beside a job: no torch, no transformers, and on a SQLite store not
    even SQLAlchemy (its import is most of a read's time)."""
    url, job_id = running_store(tmp_path)
    code = (f"import json, sys; from layerbus.cli.main import main; main(['top', {job_id!r}, '--once', '--db', "
            f"{url!r}]); heavy = [m for m in ('torch', 'transformers', 'zmq', 'pyarrow', 'sqlalchemy') "
            "if m in sys.modules]; print(json.dumps(heavy))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={"LAYERBUS_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "stage-0" in result.stdout
    assert json.loads(result.stdout.splitlines()[-1]) == []
