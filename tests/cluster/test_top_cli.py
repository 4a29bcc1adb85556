"""`layerbus top`: one frame from a PostgreSQL store, one during a real 2-stage run, and the interactive view on a
real terminal (tmux)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time

import pytest

from layerbus.cli.main import main
from layerbus.storage.store import JobStore
from tests.helpers.cli import (RUN_TIMEOUT_S, cli_env, documents, layerbus, layerbus_executable, start_run,
                               wait_for_job, write_jsonl)
from tests.helpers.stage_snapshots import BROKER, running_store, stage


def test_once_reads_a_postgresql_store(tmp_path, capsys, postgres_fresh_url):
    url, job_id = running_store(tmp_path, url=postgres_fresh_url)
    assert main(["top", "--once", "--db", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"layerbus top  {job_id} (demo)  in_progress")
    assert [line.split()[0] for line in lines[6:]] == ["stage-0", "stage-1"]


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
