"""`layerbus top`: one frame from a real store, light enough to leave running, during a real 2-stage run, and
the interactive view on a real terminal (tmux)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from layerbus.cli.main import main
from layerbus.storage.snapshot_records import StageSnapshot
from layerbus.storage.store import JobStore
from tests.helpers.cli import (REPO, RUN_TIMEOUT_S, cli_env, documents, layerbus, layerbus_executable, start_run,
                               wait_for_job, write_jsonl)
from tests.helpers.store_items import SETTINGS, new_items

BROKER = "box-a:4242:0a1b2c3d"


def stage(name: str, position: int, busy: float, **changes) -> StageSnapshot:
    fields = dict(stage=name, position=position, host="box-a", device="cpu", layer_start=position * 2,
                  layer_end=position * 2 + 2, weights="fp32", wire="float32" if position == 0 else None,
                  state="ready", busy_ratio=busy, step_s=0.0123, steps=812, tokens=9000, peak_rss_bytes=412 << 20,
                  memory_budget_bytes=2 << 30, bytes_out=10**8, out_bytes_per_s=2.1e6, heartbeat_age_s=0.3)
    return StageSnapshot(**{**fields, **changes})


def running_store(tmp_path: Path, busy: float = 0.93, url: str | None = None) -> tuple[str, str]:
    """A store (default: a SQLite file) with one failed job and, newer, one running job with two stages' snapshots."""
    url = url or f"sqlite:///{tmp_path / 'jobs.db'}"
    with JobStore.open(url) as store:
        earlier = store.create_job(SETTINGS, new_items(1), now=datetime.now(timezone.utc) - timedelta(hours=1))
        store.claim_items(earlier, "w", 1)
        job_id = store.create_job(SETTINGS, new_items(4))
        store.claim_items(job_id, BROKER, 2)
        store.record_stage_snapshots(job_id, BROKER, [stage("stage-1", 1, busy), stage("stage-0", 0, busy)])
        store.set_job_status(earlier, "failed", error="a test")
    return url, job_id


def test_once_prints_the_running_jobs_stages(tmp_path, capsys):
    url, job_id = running_store(tmp_path)

    assert main(["top", "--once", "--db", url]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"layerbus top  {job_id} (demo)  in_progress")
    assert lines[4].startswith(f"broker {BROKER}  snapshot ")
    assert [line.split()[:4] for line in lines[6:]] == [["stage-0", "box-a", "[0,", "2)"],
                                                         ["stage-1", "box-a", "[2,", "4)"]]
    assert all(" 93% " in line for line in lines[6:])


def test_once_reads_a_postgresql_store(tmp_path, capsys, postgres_fresh_url):
    url, job_id = running_store(tmp_path, url=postgres_fresh_url)
    assert main(["top", "--once", "--db", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"layerbus top  {job_id} (demo)  in_progress")
    assert [line.split()[0] for line in lines[6:]] == ["stage-0", "stage-1"]


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


@pytest.mark.cluster
def test_once_during_a_real_two_stage_run_lists_both_stages_with_spans_and_busy_figures(tmp_path, tiny_models):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(200))  # far more than runs while top reads
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    home = tmp_path / "home"
    log = tmp_path / "run.log"
    # --partition balanced: both stages take part (a fresh-clone run saw the planner, rightly on 2 cores,
    # leave one as a spare, so there was no second span to list)
    run = start_run(home, log, corpus, "--task", "summarize", "--model", tiny_models("llama"), "--stages", "2",
                    "--db", db, "--max-new-tokens", "64", "--slots", "2", "--threads-per-stage", "1",
                    "--partition", "balanced")
    try:
        job_id = wait_for_job(db, lambda status: status.in_progress > 0, "claimed items", run, log)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:  # the first snapshot has no interval to measure busy over: wait for one that has
            shown = layerbus(home, "top", "--once", "--db", db)
            assert shown.returncode == 0, shown.stderr
            rows = [line.split() for line in shown.stdout.splitlines() if line.startswith("stage-")]
            if len(rows) == 2 and all(row[7].endswith("%") for row in rows):
                break
            assert run.poll() is None and time.monotonic() < deadline, f"{shown.stdout}\n{log.read_text()}"
            time.sleep(0.5)
        assert f"layerbus top  {job_id}" in shown.stdout.splitlines()[0]
        assert " in_progress " in shown.stdout.splitlines()[0], "read while the job runs"
    finally:
        run.terminate()
        run.wait(RUN_TIMEOUT_S)
    assert {row[0] for row in rows} == {"stage-0", "stage-1"}
    spans = sorted((int(row[2].strip("[,")), int(row[3].rstrip(")"))) for row in rows)
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] < spans[1][1], f"contiguous spans: {rows}"
    assert all(row[6] == "ready" for row in rows), rows
    assert all(0 <= int(row[7].rstrip("%")) <= 100 for row in rows), rows


def tmux(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30)


def wait_for_screen(session: str, wanted, what: str) -> str:
    deadline = time.monotonic() + 60
    while True:
        screen = tmux("capture-pane", "-p", "-t", session).stdout
        if wanted(screen):
            return screen
        assert time.monotonic() < deadline, f"no {what} on the screen within 60 s:\n{screen}"
        time.sleep(0.2)


@pytest.mark.cluster
def test_interactive_view_redraws_in_place_and_q_quits(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: the interactive view needs a real terminal to check "
                    "(`apt-get install tmux`)")
    url, job_id = running_store(tmp_path, busy=0.93)
    session = f"layerbus-top-{time.monotonic_ns()}"
    command = " ".join(shlex.quote(word) for word in [layerbus_executable(), "top", "--db", url, "--interval", "0.2"])
    env = cli_env(tmp_path / "home")
    started = subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "30",
                              f"{command}; echo top exited $?; sleep 60"], env=env, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    try:
        first = wait_for_screen(session, lambda s: "stage-1" in s, "stage table")
        assert first.splitlines()[0].startswith(f"layerbus top  {job_id}")
        assert "q quits" in first and " 93% " in first
        with JobStore.open(url) as store:  # the broker writes again: the same screen shows the new figures
            store.record_stage_snapshots(job_id, BROKER, [stage("stage-0", 0, 0.41), stage("stage-1", 1, 0.41)])
        redrawn = wait_for_screen(session, lambda s: " 41% " in s, "refreshed figures")
        assert " 93% " not in redrawn and redrawn.count("layerbus top  ") == 1, "redrawn in place"
        tmux("send-keys", "-t", session, "q")
        after = wait_for_screen(session, lambda s: "top exited" in s, "exit")
        assert "top exited 0" in after
        assert "stage-0" not in after, "the shell's screen is back (the view ran on the alternate screen)"
    finally:
        tmux("kill-session", "-t", session)
