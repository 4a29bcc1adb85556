"""`layerbus broker --stages N --chains K` end to end with real processes: two stages started by hand at one
address form two chains, both work one job, and the outputs are a single broker's, every item once; a killed
chain's broker is started again; a chain that cannot go on sends its survivor to the other chain."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from layerbus.cli.main import build_parser
from layerbus.storage import JobStore
from tests.helpers.cli import assert_parquet_matches_store, cli_env, layerbus, layerbus_executable, status_json
from tests.helpers.fixtures_cli import model  # noqa: F401 - fixture
from tests.helpers.fixtures_one_broker import ITEMS, JOB_ARGS, TIMEOUT_S
from tests.helpers.fixtures_one_broker import corpus, one_brokers_outputs  # noqa: F401 - fixtures
from tests.helpers.processes import free_ports, logs_of, wait_until
from tests.helpers.store_items import GHOST


def chains_formed(log: Path, asked: str) -> int | None:
    """How many chains the front door runs: --chains K, or under auto what it said it chose (None: not yet)."""
    if asked != "auto":
        return int(asked)
    found = re.search(r"--chains auto: (\d+) chain\(s\)", log.read_text())
    return int(found.group(1)) if found else None


def cluster_keys(home: Path, folder: Path, stages: int) -> tuple[list[str], list[list[str]]]:
    """CURVE on every link: the broker's keypair and its allowlist of the stages' own public keys; the
    broker's options, and each stage's (its secret key and the broker's public key)."""
    allowed = folder / "allowed"
    allowed.mkdir(parents=True)
    made = layerbus(home, "keys", "new", folder / "broker", "--name", "broker")
    assert made.returncode == 0, made.stderr
    stage_args = []
    for i in range(stages):
        made = layerbus(home, "keys", "new", folder / "stages", "--name", f"stage-{i}")
        assert made.returncode == 0, made.stderr
        (allowed / f"stage-{i}.key").write_bytes((folder / "stages" / f"stage-{i}.key").read_bytes())
        stage_args.append(["--keys", str(folder / "stages" / f"stage-{i}.key_secret"),
                           "--broker-key", str(folder / "broker" / "broker.key")])
    return ["--keys", str(folder / "broker"), "--allow", str(allowed)], stage_args


# The --chains 2 run is secured (CURVE on every link, an allowlist): each chain's broker must take the
# front door's keys, or the stages, CURVE clients of that key, could not reach it and the run times out.
# Both cases follow the same redirects, so the suite does not pay for an unsecured --chains 2 run too.
@pytest.mark.parametrize("chains, secured", [("2", True), ("auto", False)], ids=["2-curve", "auto"])
def test_two_stages_at_one_address_form_chains_that_share_the_job_with_one_brokers_outputs(
        chains, secured, tmp_path, model, corpus, one_brokers_outputs):
    home, db, port = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}", free_ports(6)
    broker_keys, stage_keys = cluster_keys(home, tmp_path / "keys", 2) if secured else ([], [[], []])
    submitted = layerbus(home, "submit", corpus, "--model", model, "--db", db, *JOB_ARGS)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    with JobStore.open(db) as store:  # every item held elsewhere until every chain works the job (as in
        assert len(store.claim_items(job_id, GHOST, ITEMS, lease_s=3600)) == ITEMS  # test_brokers_one_job)
    logs = tmp_path / "logs"
    logs.mkdir()
    front_log = logs / "front.log"
    processes: list[subprocess.Popen] = []
    try:
        with open(front_log, "w") as handle:
            front = subprocess.Popen([layerbus_executable(), "-v", "broker", "--model", str(model), "--stages", "2",
                                      "--chains", chains, "--db", db, "--bind-control", f"tcp://127.0.0.1:{port}",
                                      "--bind-results", f"tcp://127.0.0.1:{port + 1}", "--exit-when-idle",
                                      "--poll", "0.2", "--lease", "6", *broker_keys],
                                     env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT)
        processes.append(front)
        for i in range(2):
            with open(logs / f"stage-{i}.log", "w") as handle:
                processes.append(subprocess.Popen(
                    [layerbus_executable(), "-v", "stage", "--broker", f"tcp://127.0.0.1:{port}", "--name",
                     f"stage-{i}", "--threads", "1", *stage_keys[i]], env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT))
        wait_until(no_chain_ended(front_log, logs, lambda: chains_formed(front_log, chains) is not None),
                   "choice of chains", processes, logs)
        formed = chains_formed(front_log, chains)
        with JobStore.open(db) as store:
            wait_until(no_chain_ended(front_log, logs, lambda: len(store.job_workers(job_id)) == formed),
                       "every chain on the job", processes, logs)
            assert store.requeue_expired(job_id, holders=[GHOST]) == {GHOST: ITEMS}
        try:
            code = front.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the front door did not exit once idle:\n{logs_of(logs)}") from None
        assert code == 0, logs_of(logs)
        assert [stage.wait(30) for stage in processes[1:]] == [0, 0], "stages stop when their broker says so"
    finally:
        for process in processes:
            process.kill()
    said = front_log.read_text()
    assert "stage stage-0" in said and "stage stage-1" in said, said
    assert all(f"-> chain {k + 1}" in said for k in range(formed)), said

    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == ITEMS
    rows = assert_parquet_matches_store(db, job_id, status["results_path"])
    assert sorted(row["custom_id"] for row in rows) == sorted(one_brokers_outputs), "every custom_id exactly once"
    assert {row["custom_id"]: row["output"] for row in rows} == one_brokers_outputs, "token for token one broker's"
    done = [worker["items_done"] for worker in status["workers"]]
    assert len(done) == formed and all(count > 0 for count in done) and sum(done) == ITEMS, status["workers"]


def no_chain_ended(front_log: Path, logs: Path, condition):
    """`condition`, failing at once if the front door says a chain's broker ended (a chain that cannot bind
    its port exits 2, and the other chain alone keeps the front door running: waiting would take minutes)."""
    def checked() -> bool:
        assert "broker ended with exit code" not in front_log.read_text(), f"a chain's broker ended:\n{logs_of(logs)}"
        return condition()

    return checked


def chain_broker_pid(front: subprocess.Popen, label: str) -> int | None:
    """The pid of the front door's child broker for `label` ("chain 1"), from its command line."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == front.pid and b"--chain-label" in words and words[words.index(b"--chain-label") + 1] == label.encode():
            return int(entry.name)
    return None


def test_a_serving_front_door_starts_a_killed_chain_again_and_sigterm_stops_every_chain(tmp_path, model):
    port = free_ports(6)
    log = tmp_path / "front.log"
    with open(log, "w") as handle:
        front = subprocess.Popen([layerbus_executable(), "broker", "--model", str(model), "--stages", "2", "--chains",
                                  "2", "--db", f"sqlite:///{tmp_path / 'jobs.db'}", "--bind-control",
                                  f"tcp://127.0.0.1:{port}", "--bind-results", f"tcp://127.0.0.1:{port + 1}"],
                                 env=cli_env(tmp_path / "home"), stdout=handle, stderr=subprocess.STDOUT)
    try:
        def wait_for(condition, what):
            deadline = time.monotonic() + TIMEOUT_S
            while not condition():
                assert front.poll() is None, f"the front door ended ({front.returncode}):\n{log.read_text()}"
                assert time.monotonic() < deadline, f"no {what}:\n{log.read_text()}"
                time.sleep(0.1)

        wait_for(lambda: log.read_text().count("sent here by the front door") == 2, "two chain brokers listening")
        first = chain_broker_pid(front, "chain 1")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: "chain 1's broker ended with exit code -9; starting it again" in log.read_text(), "restart")
        wait_for(lambda: log.read_text().count("sent here by the front door") == 3, "chain 1's broker listening again")
        second = chain_broker_pid(front, "chain 1")
        assert second not in (None, first)
        brokers = [second, chain_broker_pid(front, "chain 2")]

        front.send_signal(signal.SIGTERM)
        assert front.wait(TIMEOUT_S) == 143, log.read_text()
        for pid in brokers:  # each chain's broker was stopped by the signal passed on, not left behind
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2] \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    finally:
        front.kill()
    assert "SIGTERM: stopped every chain" in log.read_text(), log.read_text()


SECOND_GHOST = "ghost-host:2:0ff"
FOLD_ARGS = ("--weights", "fp32", "--slots", "8", "--micro-batches", "2", "--max-step-tokens", "32", "--max-context",
             "128", "--no-prefix-cache", "--lease", "6", "--liveness-window", "2", "--poll", "0.2")


def half_model_budget(model: Path) -> int:
    """Memory (--emulate-memory) in which two stages hold the model under FOLD_ARGS' batching but one does not."""
    from layerbus.planner.model_memory import model_memory
    from layerbus.planner.placement import PlacementError, PlanOptions, StageProfile, plan_placement
    from layerbus.cli.options import batching_from_args
    from layerbus.models.model_files import open_model_dir

    args = build_parser(lambda name: name == "broker").parse_args(["broker", "--stages", "2", *FOLD_ARGS])
    batching, memory = batching_from_args(args), model_memory(open_model_dir(model))

    def fits(budget: int, stages: int) -> bool:
        profiles = [StageProfile(f"s{i}", 1e-3, 1e-2, 1e-4, 1e-3, budget) for i in range(stages)]
        try:
            return len(plan_placement(profiles, memory, batching.resolved(stages),
                                      PlanOptions(max_auto_level=0)).order) == stages
        except PlacementError:
            return False

    two = next(b for b in range(1 << 14, 1 << 32, 1 << 12) if fits(b, 2))
    one = next(b for b in range(two, 1 << 32, 1 << 12) if fits(b, 1))
    return (two + one) // 2  # a margin either way


def test_a_chain_that_cannot_go_on_sends_its_survivor_to_the_other_chain_which_puts_it_to_work(
        tmp_path, model, corpus, one_brokers_outputs):
    """Chain 1 is stage-b and stage-c, each with memory for half the model; chain 2 is stage-a, which holds
    it all but runs at a fifth of the speed. stage-c is killed mid-job: stage-b alone cannot hold the model,
    so chain 1 leaves the job to chain 2 after a lease and sends stage-b back to the front door, which sends
    it on to chain 2, whose broker puts it to work (Broker.grow). The front door exits 0 (the job completed),
    the outputs are one broker's, every item once."""
    home, db, port = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}", free_ports(6)
    budget = half_model_budget(model)
    submitted = layerbus(home, "submit", corpus, "--model", model, "--db", db, *JOB_ARGS)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    with JobStore.open(db) as store:  # the first third for both chains; the rest held until stage-b moved
        assert len(store.claim_items(job_id, GHOST, ITEMS // 3, lease_s=3600)) == ITEMS // 3
        assert len(store.claim_items(job_id, SECOND_GHOST, ITEMS, lease_s=3600)) == ITEMS - ITEMS // 3
    logs = tmp_path / "logs"
    logs.mkdir()
    front_log = logs / "front.log"
    processes: dict[str, subprocess.Popen] = {}

    def start_stage(name: str, *args: str) -> None:
        with open(logs / f"{name}.log", "w") as handle:
            processes[name] = subprocess.Popen(
                [layerbus_executable(), "-v", "stage", "--broker", f"tcp://127.0.0.1:{port}", "--name", name,
                 "--threads", "1", *args], env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT)

    def said(text: str) -> bool:
        return text in front_log.read_text()

    try:
        with open(front_log, "w") as handle:
            processes["front"] = subprocess.Popen(
                [layerbus_executable(), "-v", "broker", "--model", str(model), "--stages", "3", "--chains", "2",
                 "--job", job_id, "--db", db, "--bind-control", f"tcp://127.0.0.1:{port}", "--bind-results",
                 f"tcp://127.0.0.1:{port + 1}", *FOLD_ARGS], env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT)
        def running() -> list[subprocess.Popen]:
            return list(processes.values())

        for name in ("stage-b", "stage-c"):  # the first two to register form chain 1
            start_stage(name, "--emulate-memory", str(budget))
            wait_until(lambda: said(f"stage {name} (host"), f"{name} sent on", running(), logs)
        start_stage("stage-a", "--emulate-speed", "0.2")
        with JobStore.open(db) as store:
            wait_until(lambda: len(store.job_workers(job_id)) == 2, "both chains on the job", running(), logs)
            assert "-> chain 1" in front_log.read_text().split("stage stage-c")[1].split("\n")[0]
            assert store.requeue_expired(job_id, holders=[GHOST]) == {GHOST: ITEMS // 3}

            def chain_1_worked() -> bool:
                return any("stage-b" in (w.chain or "") and w.items_done > 0 for w in store.job_workers(job_id))

            wait_until(chain_1_worked, "work by chain 1", running(), logs)
            processes.pop("stage-c").kill()
            wait_until(lambda: said("stage stage-b (host") and said("-> chain 2") and
                       front_log.read_text().count("stage stage-b (host") == 2, "stage-b sent on to chain 2", running(), logs)
            assert store.requeue_expired(job_id, holders=[SECOND_GHOST]) == {SECOND_GHOST: ITEMS - ITEMS // 3}
        try:
            code = processes["front"].wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the front door did not exit once the job completed:\n{logs_of(logs)}") from None
        assert code == 0, logs_of(logs)
        assert [processes[name].wait(30) for name in ("stage-a", "stage-b")] == [0, 0], logs_of(logs)
    finally:
        for process in processes.values():
            process.kill()
    moved = front_log.read_text().split("stage stage-b (host")[2].split("\n")[0]
    assert "-> chain 2" in moved, front_log.read_text()
    assert said("chain 1's broker ended with exit code 4 (its stages broke"), front_log.read_text()
    assert "dropping layers" in (logs / "stage-b.log").read_text()

    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == ITEMS
    rows = assert_parquet_matches_store(db, job_id, status["results_path"])
    assert sorted(row["custom_id"] for row in rows) == sorted(one_brokers_outputs), "every custom_id exactly once"
    assert {row["custom_id"]: row["output"] for row in rows} == one_brokers_outputs, "token for token one broker's"
    events = status["events"]
    assert any(event["kind"] == "worker_left" for event in events), events
    grown = [event["message"] for event in events if event["kind"] == "grown"]
    assert len(grown) == 1 and grown[0].startswith("stage-b joined"), events
