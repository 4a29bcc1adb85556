"""run_cluster.sh: a broker and 2 local stages serving a job submitted from another process, then every
process it started gone after SIGTERM to the script, or after Ctrl-C to its whole process group."""

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
