"""`layerbus broker --exit-when-idle`: a job queued while the stages are still registering is served, a job
for another model is left alone, and then the broker exits 0 and its stages stop cleanly (what a batch
scheduler's `sbatch --wait` needs)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.helpers.cli import cli_env, layerbus, layerbus_executable, status_json, write_jsonl
from tests.helpers.processes import free_port_pair

TIMEOUT_S = 120


def wait_for_text(path: Path, text: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while text not in path.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} from the broker (exit {process.poll()}):\n{path.read_text()}")
        time.sleep(0.1)


def test_job_queued_while_stages_register_is_served_then_the_broker_exits_0(tmp_path, tiny_models):
    model, other_model = tiny_models("llama"), tiny_models("llama", seed=7)
    home, db, port = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}", free_port_pair()
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"doc-{i}", "text": f"Idle test {i}."} for i in range(4)])
    broker_log, stage_logs = tmp_path / "broker.log", [tmp_path / f"stage-{i}.log" for i in range(2)]
    stages: list[subprocess.Popen] = []
    with open(broker_log, "w") as handle:
        broker = subprocess.Popen([layerbus_executable(), "-v", "broker", "--model", str(model), "--stages", "2",
                                   "--db", db, "--bind-control", f"tcp://127.0.0.1:{port}",
                                   "--bind-results", f"tcp://127.0.0.1:{port + 1}", "--exit-when-idle",
                                   "--poll", "0.2"],
                                  env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT)
    try:
        # The store is empty when the broker starts: it must not decide "idle" before the stages are placed.
        wait_for_text(broker_log, "waiting for 2 stage(s)", broker)
        other = layerbus(home, "submit", corpus, "--task", "summarize", "--model", other_model, "--db", db,
                         "--max-new-tokens", "4")
        mine = layerbus(home, "submit", corpus, "--task", "summarize", "--model", model, "--db", db,
                        "--max-new-tokens", "6")
        assert other.returncode == 0 and mine.returncode == 0, other.stderr + mine.stderr
        for i, path in enumerate(stage_logs):
            with open(path, "w") as handle:
                stages.append(subprocess.Popen([layerbus_executable(), "-v", "stage", "--broker",
                                                f"tcp://127.0.0.1:{port}", "--name", f"stage-{i}", "--threads", "1"],
                                               env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT))
        try:
            code = broker.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the broker did not exit once idle:\n{broker_log.read_text()}") from None
        assert code == 0, broker_log.read_text()
        assert [stage.wait(30) for stage in stages] == [0, 0], "the stages stop when told, not by a timeout"
    finally:
        for process in (broker, *stages):
            process.kill()
    assert status_json(home, mine.stdout.strip(), "--db", db)["request_counts"]["completed"] == 4
    assert status_json(home, other.stdout.strip(), "--db", db)["status"] == "queued", "another model's job waits"
    assert "exiting (--exit-when-idle) after 1 job(s), 1 completed" in broker_log.read_text()
