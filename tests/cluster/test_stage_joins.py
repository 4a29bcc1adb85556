"""A stage that registers while a job runs is put to work (Broker.grow): with --partition equal the split is
made again over every stage; with planned, the new stage is profiled and the chain moves when the plan with
it is faster. Real processes: a broker started with one stage, a second `layerbus stage` started by hand
mid-job; the job's events say it joined, the chain in use ends with both, and the outputs are token for
token a one-stage run's, every item once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from layerbus.storage import JobStore
from tests.helpers.cli import assert_parquet_matches_store, cli_env, layerbus, layerbus_executable, status_json
from tests.helpers.fixtures_cli import model  # noqa: F401 - fixture
from tests.helpers.fixtures_one_broker import ITEMS, JOB_ARGS, TIMEOUT_S
from tests.helpers.fixtures_one_broker import corpus, one_brokers_outputs  # noqa: F401 - fixtures
from tests.helpers.processes import free_ports, logs_of, wait_until
from tests.helpers.store_items import GHOST

FIRST_WAVE = 8  # the broker runs this many items on one stage; the rest once the second stage has joined


def start_stage(home: Path, port: int, name: str, logs: Path, *extra: str) -> subprocess.Popen:
    with open(logs / f"{name}.log", "w") as handle:
        return subprocess.Popen([layerbus_executable(), "-v", "stage", "--broker", f"tcp://127.0.0.1:{port}", "--name",
                                 name, "--threads", "1", *extra], env=cli_env(home), stdout=handle,
                                stderr=subprocess.STDOUT)


@pytest.mark.parametrize("partition, first_stage_args", [
    ("equal", ()),
    # The first stage emulates a card 5x slower: a plan with the second stage is much faster.
    ("planned", ("--emulate-speed", "0.2")),
])
def test_a_stage_started_mid_job_joins_the_chain_and_the_outputs_do_not_change(
        partition, first_stage_args, tmp_path, model, corpus, one_brokers_outputs):
    home, db, port = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}", free_ports(2)
    submitted = layerbus(home, "submit", corpus, "--model", model, "--db", db, *JOB_ARGS)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    with JobStore.open(db) as store:  # all but the first wave held elsewhere until the second stage is there
        held = store.claim_items(job_id, GHOST, ITEMS - FIRST_WAVE, lease_s=3600)
        assert len(held) == ITEMS - FIRST_WAVE
    logs = tmp_path / "logs"
    logs.mkdir()
    broker_log = logs / "broker.log"
    processes: list[subprocess.Popen] = []
    try:
        with open(broker_log, "w") as handle:
            processes.append(subprocess.Popen(
                [layerbus_executable(), "-v", "broker", "--model", str(model), "--stages", "1", "--db", db,
                 "--partition", partition, "--bind-control", f"tcp://127.0.0.1:{port}",
                 "--bind-results", f"tcp://127.0.0.1:{port + 1}", "--exit-when-idle", "--poll", "0.2"],
                env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT))
        processes.append(start_stage(home, port, "stage-0", logs, *first_stage_args))
        with JobStore.open(db) as store:
            wait_until(lambda: store.job_status(job_id).completed == FIRST_WAVE, "first wave on one stage",
                       processes, logs)
            processes.append(start_stage(home, port, "stage-1", logs))
            wait_until(lambda: "stage stage-1 registered" in broker_log.read_text(), "stage-1 registered",
                       processes, logs)
            assert store.requeue_expired(job_id, holders=[GHOST]) == {GHOST: ITEMS - FIRST_WAVE}
        try:
            code = processes[0].wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the broker did not exit once idle:\n{logs_of(logs)}") from None
        assert code == 0, logs_of(logs)
    finally:
        for process in processes:
            process.kill()

    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == ITEMS
    rows = assert_parquet_matches_store(db, job_id, status["results_path"])
    assert sorted(row["custom_id"] for row in rows) == sorted(one_brokers_outputs), "every custom_id exactly once"
    assert {row["custom_id"]: row["output"] for row in rows} == one_brokers_outputs, "token for token one stage's"
    grown = [event for event in status["events"] if event["kind"] == "grown"]
    assert len(grown) == 1 and grown[0]["message"].startswith("stage-1 joined"), status["events"]
    assert "stage-1 [" in grown[0]["message"], grown[0]["message"]
    assert "stage-1" in status["workers"][0]["chain"], "status shows the chain in use, with the stage that joined"
