"""A cluster never strands itself, with real stage processes and brokers started by hand:

- stages started before their broker wait for it (longer than their --broker-timeout), and a stage that
  waits longer than --wait-for-broker gives up saying why;
- no stage leaves while its broker lives, whatever the broker is doing: preparing the model, waiting on the
  store (both held here for several broker timeouts, the broker in this process);
- a stage that outlives its broker registers with the next one on the same address, and serves again;
- a stage that joins mid-job is measured beside the chain's steps (they go on while its profile is held),
  and a joining stage killed before its profile answer leaves the job running;
- a stage of the chain killed while another is being profiled is noticed within the liveness window;
- a broker whose stage tasks have all ended (their launcher says so, --stage-exits) stops at once, naming
  them, and leaves the job for a later run.

Every job that completes gives the outputs of one broker on one stage, every item once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import layerbus.cli.broker_service as broker_service
from layerbus.cli.main import main as cli_main
from layerbus.storage import JobStore
from layerbus.storage.store import JobStore as StoreClass
from tests.helpers.cli import assert_parquet_matches_store, cli_env, layerbus, layerbus_executable, status_json
from tests.helpers.fixtures_cli import model  # noqa: F401 - fixture
from tests.helpers.fixtures_one_broker import ITEMS, JOB_ARGS, TIMEOUT_S
from tests.helpers.fixtures_one_broker import corpus, one_brokers_outputs  # noqa: F401 - fixtures
from tests.helpers.processes import free_ports, logs_of, wait_until
from tests.helpers.store_items import GHOST

BROKER_TIMEOUT = ("--broker-timeout", "2")  # the stages' patience once the broker has spoken
HOLD_S = 6.0  # how long a long phase is held: three broker timeouts
PREPARING = "the broker is busy: preparing the model"  # what a stage logs when told of that phase
LIVENESS = ("--liveness-window", "2")
# A stage that profiles as a card 5x slower (a plan with a second stage is much faster) and serves steps 250x
# slower than this machine's (its profile does not see that part): the job lasts while another stage joins.
SLOW_STAGE = ("--emulate-speed", "0.2", "--emulate-slowdown", "0:0.02")
FEW_SLOTS = ("--slots", "4")  # items finish a few at a time, over many steps


def start_stage(home: Path, port: int, name: str, logs: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    with open(logs / f"{name}.log", "w") as handle:
        return subprocess.Popen([layerbus_executable(), "-v", "stage", "--broker", f"tcp://127.0.0.1:{port}", "--name",
                                 name, "--threads", "1", *extra], env={**cli_env(home), **(env or {})}, stdout=handle,
                                stderr=subprocess.STDOUT)


def start_broker(home: Path, port: int, logs: Path, *args: str, name: str = "broker") -> subprocess.Popen:
    with open(logs / f"{name}.log", "a") as handle:
        return subprocess.Popen([layerbus_executable(), "-v", "broker", *args, "--bind-control", f"tcp://127.0.0.1:{port}",
                                 "--bind-results", f"tcp://127.0.0.1:{port + 1}", "--poll", "0.2"],
                                env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT)


def submit(home: Path, corpus: Path, model: Path, db: str, held: int = 0) -> str:
    done = layerbus(home, "submit", corpus, "--model", model, "--db", db, *JOB_ARGS)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    if held:
        with JobStore.open(db) as store:
            assert len(store.claim_items(job_id, GHOST, held, lease_s=3600)) == held
    return job_id


def release(db: str, job_id: str) -> None:
    with JobStore.open(db) as store:
        store.requeue_expired(job_id, holders=[GHOST])


def assert_completed_as_one_broker(home: Path, db: str, job_id: str, expected: dict[str, str], logs: Path) -> dict:
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == ITEMS, logs_of(logs)
    rows = assert_parquet_matches_store(db, job_id, status["results_path"])
    assert sorted(row["custom_id"] for row in rows) == sorted(expected), "every custom_id exactly once"
    assert {row["custom_id"]: row["output"] for row in rows} == expected, "token for token one broker's"
    return status


def events(home: Path, db: str, job_id: str, kind: str) -> list[dict]:
    return [event for event in status_json(home, job_id, "--db", db)["events"] if event["kind"] == kind]


def finish(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(30)


@pytest.fixture
def setup(tmp_path, model, corpus):
    logs = tmp_path / "logs"
    logs.mkdir()
    return tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}", free_ports(2), logs


def test_stages_started_before_their_broker_wait_for_it(setup, model, corpus, one_brokers_outputs):
    home, db, port, logs = setup
    job_id = submit(home, corpus, model, db)
    processes = [start_stage(home, port, f"stage-{i}", logs, *BROKER_TIMEOUT) for i in range(2)]
    try:
        time.sleep(3 * float(BROKER_TIMEOUT[1]))  # no broker yet: longer than they wait for a silent one
        assert all(p.poll() is None for p in processes), logs_of(logs)
        processes.append(start_broker(home, port, logs, "--model", str(model), "--stages", "2", "--db", db,
                                      "--job", job_id))
        assert processes[-1].wait(TIMEOUT_S) == 0, logs_of(logs)
        assert [p.wait(30) for p in processes[:2]] == [0, 0], "told to stop by the broker, not left on their own"
    finally:
        finish(processes)
    assert_completed_as_one_broker(home, db, job_id, one_brokers_outputs, logs)


def test_a_stage_gives_up_after_wait_for_broker_saying_why(setup):
    home, _, port, logs = setup
    stage = start_stage(home, port, "stage-0", logs, "--wait-for-broker", "1")
    try:
        assert stage.wait(120) == 3
    finally:
        finish([stage])
    assert f"no answer from the broker at tcp://127.0.0.1:{port} within --wait-for-broker 1 s" in logs_of(logs)


def run_broker_here(model: Path, db: str, port: int, job_id: str, *extra: str) -> int:
    return cli_main(["-v", "broker", "--model", str(model), "--stages", "2", "--db", db, "--job", job_id,
                     "--bind-control", f"tcp://127.0.0.1:{port}", "--bind-results", f"tcp://127.0.0.1:{port + 1}",
                     *LIVENESS, *extra])


def test_no_stage_leaves_while_its_broker_prepares_the_model(setup, model, corpus, one_brokers_outputs, monkeypatch):
    home, db, port, logs = setup
    job_id = submit(home, corpus, model, db)
    real = broker_service.resolve_model

    def slow_preparation(name):
        # A download and an import, as on a fresh home: held until both stages have been told (however long
        # their own start takes on a loaded machine), then for three broker timeouts more.
        told = lambda: all(PREPARING in (logs / f"stage-{i}.log").read_text() for i in range(2))  # noqa: E731
        deadline = time.monotonic() + TIMEOUT_S
        while not told() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(HOLD_S)
        return real(name)

    monkeypatch.setattr(broker_service, "resolve_model", slow_preparation)
    monkeypatch.setenv("LAYERBUS_HOME", str(home))
    processes = [start_stage(home, port, f"stage-{i}", logs, *BROKER_TIMEOUT) for i in range(2)]
    try:
        assert run_broker_here(model, db, port, job_id) == 0, logs_of(logs)
        assert [p.wait(30) for p in processes] == [0, 0], logs_of(logs)
    finally:
        finish(processes)
    assert_completed_as_one_broker(home, db, job_id, one_brokers_outputs, logs)
    assert all(PREPARING in (logs / f"stage-{i}.log").read_text() for i in range(2))


def test_no_stage_leaves_while_its_broker_waits_on_the_store(setup, model, corpus, one_brokers_outputs, monkeypatch):
    home, db, port, logs = setup
    job_id = submit(home, corpus, model, db)
    real, slowed = StoreClass.claim_items, []

    def slow_claim(self, *args, **kwargs):
        if not slowed:  # the first claim of the run: a locked SQLite file, a far PostgreSQL server
            slowed.append(True)
            time.sleep(HOLD_S)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StoreClass, "claim_items", slow_claim)
    monkeypatch.setenv("LAYERBUS_HOME", str(home))
    processes = [start_stage(home, port, f"stage-{i}", logs, *BROKER_TIMEOUT) for i in range(2)]
    try:
        assert run_broker_here(model, db, port, job_id) == 0, logs_of(logs)
        assert [p.wait(30) for p in processes] == [0, 0], logs_of(logs)
    finally:
        finish(processes)
    assert slowed, "the store was slow"
    assert_completed_as_one_broker(home, db, job_id, one_brokers_outputs, logs)


def test_a_stage_that_outlives_its_broker_serves_the_next_one(setup, model, corpus, one_brokers_outputs):
    home, db, port, logs = setup
    job_id = submit(home, corpus, model, db, held=ITEMS - 8)
    stage = start_stage(home, port, "stage-0", logs, "--broker-timeout", "60")
    first = start_broker(home, port, logs, "--model", str(model), "--stages", "1", "--db", db, "--job", job_id)
    processes = [stage, first]
    try:
        with JobStore.open(db) as store:
            wait_until(lambda: store.job_status(job_id).completed >= 8, "the first items", processes, logs)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        release(db, job_id)
        processes.append(start_broker(home, port, logs, "--model", str(model), "--stages", "1", "--db", db,
                                      "--job", job_id, "--lease", "5"))
        assert processes[-1].wait(TIMEOUT_S) == 0, logs_of(logs)
        assert stage.wait(30) == 0, "the same stage process served both brokers, then was told to stop"
    finally:
        finish(processes)
    assert_completed_as_one_broker(home, db, job_id, one_brokers_outputs, logs)


HELD = 16  # items run while the joining stage's profile is held


def held_profile(tmp_path: Path) -> tuple[Path, dict]:
    hold = tmp_path / "hold-profile"
    hold.touch()
    return hold, {"LAYERBUS_HOLD_PROFILE_WHILE": str(hold)}


def join_mid_job(home: Path, db: str, port: int, logs: Path, model: Path, job_id: str, env: dict,
                 processes: list[subprocess.Popen]) -> subprocess.Popen:
    """A broker on one slowed stage, its first items done, then stage-1 started (its profile held) and
    registered; the processes started are appended to `processes`; stage-1's."""
    processes += [start_broker(home, port, logs, "--model", str(model), "--stages", "1", "--db", db, "--job", job_id,
                               *LIVENESS, *FEW_SLOTS),
                  start_stage(home, port, "stage-0", logs, *SLOW_STAGE)]
    with JobStore.open(db) as store:
        wait_until(lambda: store.job_status(job_id).completed >= 2, "the first items", processes, logs)
    joining = start_stage(home, port, "stage-1", logs, env=env)
    processes.append(joining)
    broker_log = logs / "broker.log"
    wait_until(lambda: "stage stage-1 registered" in broker_log.read_text(), "stage-1 registered", processes, logs)
    return joining


def test_a_stage_that_joins_is_measured_while_the_steps_go_on(setup, tmp_path, model, corpus, one_brokers_outputs):
    home, db, port, logs = setup
    job_id = submit(home, corpus, model, db)
    hold, env = held_profile(tmp_path)
    processes: list[subprocess.Popen] = []
    try:
        join_mid_job(home, db, port, logs, model, job_id, env, processes)
        with JobStore.open(db) as store:
            joined_at = store.job_status(job_id).completed
            wait_until(lambda: store.job_status(job_id).completed >= min(ITEMS, joined_at + 3),
                       "steps while stage-1's profile is held", processes, logs)
            assert hold.exists() and not events(home, db, job_id, "grown"), "measured beside the steps, not before"
            hold.unlink()
        assert processes[0].wait(TIMEOUT_S) == 0, logs_of(logs)
    finally:
        finish(processes)
    assert_completed_as_one_broker(home, db, job_id, one_brokers_outputs, logs)
    grown = events(home, db, job_id, "grown")
    assert len(grown) == 1 and grown[0]["message"].startswith("stage-1 joined"), logs_of(logs)


def test_a_joining_stage_killed_before_its_profile_answer_leaves_the_job_running(
        setup, tmp_path, model, corpus, one_brokers_outputs):
    home, db, port, logs = setup
    job_id = submit(home, corpus, model, db)
    hold, env = held_profile(tmp_path)
    processes: list[subprocess.Popen] = []
    try:
        joining = join_mid_job(home, db, port, logs, model, job_id, env, processes)
        time.sleep(1.0)  # its profile asked for, and held
        processes.remove(joining)
        joining.send_signal(signal.SIGKILL)
        joining.wait(30)
        assert processes[0].wait(TIMEOUT_S) == 0, logs_of(logs)
    finally:
        hold.unlink(missing_ok=True)
        finish(processes)
    assert_completed_as_one_broker(home, db, job_id, one_brokers_outputs, logs)
    # Killed while measured: said lost once, as any lost stage (by the spare watch or by the join that measured it),
    # and the join says it was left out.
    [lost] = [event for event in events(home, db, job_id, "stage_lost") if "stage-1" in event["message"]]
    left_out = [event for event in events(home, db, job_id, "stage_lost") + events(home, db, job_id, "joined")
                if "left out, the job goes on" in event["message"]]
    assert left_out and "stage-1" in left_out[0]["message"], (lost, left_out)


def test_a_chain_stage_killed_while_another_is_profiled_is_noticed_in_time(
        setup, tmp_path, model, corpus, one_brokers_outputs):
    home, db, port, logs = setup
    job_id = submit(home, corpus, model, db)
    hold, env = held_profile(tmp_path)
    processes = [start_broker(home, port, logs, "--model", str(model), "--stages", "2", "--db", db, "--job", job_id,
                              *LIVENESS, *FEW_SLOTS),
                 start_stage(home, port, "stage-0", logs, *SLOW_STAGE),
                 start_stage(home, port, "stage-2", logs, *SLOW_STAGE)]
    try:
        with JobStore.open(db) as store:
            wait_until(lambda: store.job_status(job_id).completed >= 2, "the first items", processes, logs)
        # Registered mid-job, it is profiled beside the steps (held here), and the loss of stage-2 meanwhile
        # must be noticed all the same.
        processes.append(start_stage(home, port, "stage-1", logs, env=env))
        broker_log = logs / "broker.log"
        wait_until(lambda: "stage stage-1 registered" in broker_log.read_text(), "stage-1 registered", processes, logs)
        killed = processes.pop(2)
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        wait_until(lambda: events(home, db, job_id, "stage_lost"), "stage-2's loss recorded", processes, logs)
        assert "stage-2" in events(home, db, job_id, "stage_lost")[0]["message"]
        hold.unlink()
        assert processes[0].wait(TIMEOUT_S) == 0, logs_of(logs)
    finally:
        hold.unlink(missing_ok=True)
        finish(processes)
    assert_completed_as_one_broker(home, db, job_id, one_brokers_outputs, logs)


def test_a_broker_whose_stage_tasks_have_all_ended_stops_naming_them(setup, model, corpus):
    home, db, port, logs = setup
    job_id = submit(home, corpus, model, db)
    exits = logs.parent / "stage-exits"
    exits.mkdir()
    broker = start_broker(home, port, logs, "--model", str(model), "--stages", "2", "--db", db, "--job", job_id,
                          "--stage-exits", str(exits))
    try:
        (exits / "task-1.exit").write_text("node-task-1 137 4001\n")
        (exits / "task-2.exit").write_text("node-task-2 2 4002\n")
        assert broker.wait(120) == 1, logs_of(logs)
    finally:
        finish([broker])
    said = (logs / "broker.log").read_text()
    assert "none of the 2 stages can serve" in said and "node-task-1 (pid 4001) its task ended with exit code 137" \
        in said and "node-task-2 (pid 4002) its task ended with exit code 2" in said, said
    assert status_json(home, job_id, "--db", db)["status"] == "queued", "nothing done, nothing lost: for a later run"
    assert os.path.exists(exits / "task-1.exit")
