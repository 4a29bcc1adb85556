"""run_cluster.sh: a broker and 2 local stages serving a job submitted from another process, then every
process it started gone after SIGTERM to the script, or after Ctrl-C to its whole process group; a remote
stage started a minute before the cluster waits for its broker and serves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import zmq

from layerbus.wire import protocol
from layerbus.wire.frames import decode
from tests.helpers.cli import REPO, cli_env, layerbus, status_json, write_jsonl
from tests.helpers.fixtures_cli import tiny  # noqa: F401 - fixture
from tests.helpers.processes import free_port_pair

SCRIPT = REPO / "run_cluster.sh"
STARTED = re.compile(r"^(broker|stage-\d+) pid (\d+)", re.MULTILINE)
TIMEOUT_S = 90


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def start_cluster(tmp_path: Path, tiny: Path, **popen) -> tuple[subprocess.Popen, Path, str, Path]:
    home, logs, out = tmp_path / "home", tmp_path / "logs", tmp_path / "cluster.out"
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    with open(out, "w") as handle:
        script = subprocess.Popen(["bash", str(SCRIPT), "--stages", "2", "--model", str(tiny), "--db", db,
                                   "--log-dir", str(logs), "--port", str(free_port_pair())],
                                  env=cli_env(home), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, **popen)
    return script, home, db, out


def started_pids(out: Path) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = {name: int(pid) for name, pid in STARTED.findall(out.read_text())}
        if len(found) == 3:
            return found
        time.sleep(0.05)
    raise AssertionError(f"run_cluster.sh did not report its 3 processes:\n{out.read_text()}")


def wait_for(condition, what: str, logs: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    dump = "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log")))
    raise AssertionError(f"{what} not within {TIMEOUT_S} s\n{dump}")


def assert_all_stopped(script: subprocess.Popen, pids: dict[str, int], out: Path) -> int:
    try:
        code = script.wait(30)
    except subprocess.TimeoutExpired:
        script.kill()
        raise AssertionError(f"run_cluster.sh did not stop:\n{out.read_text()}")
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = {name: pid for name, pid in pids.items() if alive(pid)}
    for pid in survivors.values():
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"still running after the script exited: {survivors}\n{out.read_text()}"
    assert "SIGKILL" not in out.read_text(), f"a process needed SIGKILL:\n{out.read_text()}"
    return code


def test_cluster_serves_a_submitted_job_and_sigterm_stops_everything(tmp_path, tiny):
    script, home, db, out = start_cluster(tmp_path, tiny)
    pids = started_pids(out)
    try:
        corpus = write_jsonl(tmp_path / "docs.jsonl",
                             [{"id": f"doc-{i}", "text": f"A worker claims job {i}."} for i in range(6)])
        submitted = layerbus(home, "submit", corpus, "--task", "summarize", "--model", tiny, "--db", db,
                             "--max-new-tokens", "8")
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        wait_for(lambda: status_json(home, job_id, "--db", db)["status"] == "completed", "job completed",
                 tmp_path / "logs")
        assert all(alive(pid) for pid in pids.values()), "the cluster keeps serving after a job"
        script.send_signal(signal.SIGTERM)
        assert assert_all_stopped(script, pids, out) == 143
    finally:
        script.kill()
    status = status_json(home, job_id, "--db", db)
    assert status["request_counts"]["completed"] == 6 and Path(status["results_path"]).is_file()
    assert "stopped" in (tmp_path / "logs" / "broker.log").read_text()


def test_ctrl_c_to_the_process_group_stops_everything(tmp_path, tiny):
    script, home, db, out = start_cluster(tmp_path, tiny, start_new_session=True)
    pids = started_pids(out)
    try:
        wait_for(lambda: "ready:" in (tmp_path / "logs" / "broker.log").read_text(), "stages ready",
                 tmp_path / "logs")
        os.killpg(script.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert assert_all_stopped(script, pids, out) == 130
    finally:
        script.kill()


def test_stage_mode_runs_a_stage_that_registers_and_stops_on_sigterm(tmp_path):
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)  # the broker's control socket, played by the test
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    with open(tmp_path / "stage.log", "wb") as log:
        stage = subprocess.Popen(["bash", str(SCRIPT), "stage", "--broker", f"tcp://127.0.0.1:{port}", "--name",
                                  "remote-1", "--threads", "1"], env=cli_env(tmp_path / "home"), cwd=REPO,
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        kinds = []
        deadline = time.monotonic() + TIMEOUT_S
        while protocol.REGISTER not in kinds and router.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            message = decode(router.recv_multipart()[1:])
            kinds.append(message.kind)
        assert protocol.REGISTER in kinds, f"no registration: {kinds}\n{(tmp_path / 'stage.log').read_text()}"
        assert message.header["name"] == "remote-1"
        stage.send_signal(signal.SIGTERM)
        assert stage.wait(30) == 128 + signal.SIGTERM
    finally:
        stage.kill()
        context.destroy(linger=0)


REMOTE_EARLY_S = 60  # the remote stage starts this long before the cluster: four times its --broker-timeout


def test_a_remote_stage_started_a_minute_before_the_cluster_waits_and_serves(tmp_path, tiny):
    """`run_cluster.sh stage` on "another machine" a minute before `run_cluster.sh --remote-stages 1`: the stage
    keeps registering until the broker answers (its --broker-timeout counts only once one has), then serves
    beside the local stage, and the job's outputs are those of `layerbus run` on the same input."""
    corpus = write_jsonl(tmp_path / "docs.jsonl",
                         [{"id": f"doc-{i}", "text": f"Stage {i} waited for its broker."} for i in range(8)])
    job_args = ("--task", "summarize", "--max-new-tokens", "8")
    reference_home, reference_db = tmp_path / "reference", f"sqlite:///{tmp_path / 'reference.db'}"
    run = layerbus(reference_home, "run", corpus, "--model", tiny, "--db", reference_db, *job_args, "--stages", "2",
                   "--threads-per-stage", "1", timeout=300)
    assert run.returncode == 0, run.stderr
    expected = outputs_of(status_json(reference_home, re.search(r"job_[0-9a-f]+", run.stdout).group(), "--db",
                                      reference_db)["results_path"])

    home, logs, out = tmp_path / "home", tmp_path / "logs", tmp_path / "cluster.out"
    db, port = f"sqlite:///{tmp_path / 'jobs.db'}", free_port_pair()
    logs.mkdir()
    with open(logs / "remote-1.log", "wb") as log:
        remote = subprocess.Popen(["bash", str(SCRIPT), "stage", "--broker", f"tcp://127.0.0.1:{port}", "--name",
                                   "remote-1", "--threads", "1", "--broker-timeout", "15", "--insecure"],
                                  env=cli_env(home), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    script = None
    try:
        time.sleep(REMOTE_EARLY_S)
        assert remote.poll() is None, f"the remote stage gave up:\n{(logs / 'remote-1.log').read_text()}"
        with open(out, "w") as handle:
            script = subprocess.Popen(["bash", str(SCRIPT), "--stages", "1", "--remote-stages", "1", "--insecure",
                                       "--model", str(tiny), "--db", db, "--log-dir", str(logs), "--port", str(port)],
                                      env=cli_env(home), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
        submitted = layerbus(home, "submit", corpus, "--model", tiny, "--db", db, *job_args)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        wait_for(lambda: status_json(home, job_id, "--db", db)["status"] == "completed", "job completed", logs)
        broker_log = (logs / "broker.log").read_text()
        assert "stage remote-1 registered" in broker_log, broker_log[-3000:]
        script.send_signal(signal.SIGTERM)
        script.wait(60)
        assert remote.wait(60) == 0, "the broker told the remote stage to stop"
    finally:
        for process in (script, remote):
            if process is not None and process.poll() is None:
                process.kill()
    stage_log = (logs / "remote-1.log").read_text()
    assert "waiting for the broker" in stage_log and "answered (after" in stage_log, stage_log
    status = status_json(home, job_id, "--db", db)
    assert status["request_counts"]["completed"] == 8
    assert outputs_of(status["results_path"]) == expected


def outputs_of(results_path: str) -> dict[str, str]:
    import pyarrow.parquet as pq

    return {row["custom_id"]: row["output"] for row in pq.read_table(results_path).to_pylist()}
