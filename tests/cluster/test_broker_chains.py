"""`layerbus broker --stages N --chains K`: the front door's choices as table tests (which chain a stage
joins, where a redirect sends it, each chain's ports and command line), and end to end with real processes:
two stages started by hand at one address form two chains, both work one job, and the outputs are a single
broker's, every item once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

import zmq

from layerbus.launch.front_door import ChainDoor, FrontDoor, chain_for_stage
from layerbus.launch.broker_chains import (
    MAX_CHAIN_RESTARTS,
    chain_binds,
    chain_command,
    front_door_exit,
    restarts_chain,
)
from layerbus.cli.errors import EXIT_CHAIN_LEFT, UsageError
from layerbus.cli.main import build_parser
from layerbus.cli.main import main as cli_main
from layerbus.storage import JobStore
from layerbus.wire import protocol
from layerbus.wire.frames import WireError, decode, encode
from layerbus.wire.protocol import redirect_header, redirected_endpoint
from tests.helpers.cli import assert_parquet_matches_store, cli_env, layerbus, layerbus_executable, status_json
from tests.helpers.fixtures_cli import model  # noqa: F401 - fixture
from tests.helpers.fixtures_one_broker import ITEMS, JOB_ARGS, TIMEOUT_S
from tests.helpers.fixtures_one_broker import corpus, one_brokers_outputs  # noqa: F401 - fixtures
from tests.helpers.processes import free_ports, logs_of, wait_until
from tests.helpers.store_items import GHOST


@pytest.mark.parametrize("name, assigned, sizes, chain", [
    ("a", {}, [2, 2], 0),  # the first chain fills first
    ("b", {"a": 0}, [2, 2], 0),
    ("c", {"a": 0, "b": 0}, [2, 2], 1),
    ("b", {"a": 0, "b": 1}, [2, 2], 1),  # a restarted stage goes back to its chain
    ("c", {"a": 0, "b": 1}, [1, 1], 0),  # a spare: the chain with the fewest for its size, the first of equals
    ("d", {"a": 0, "b": 1, "c": 1}, [1, 2], 0),  # 1/1 against 2/2: equal, the first
    ("d", {"a": 0, "b": 0, "c": 1}, [2, 1], 0),  # 2/2 against 1/1
    ("e", {"a": 0, "b": 0, "c": 1, "d": 0}, [2, 1], 1),  # 3/2 against 1/1
    ("c", {"a": 0, "b": 1}, [2, 1], 0),  # chain 1 still short
])
def test_chain_for_stage(name, assigned, sizes, chain):
    assert chain_for_stage(name, assigned, sizes) == chain


@pytest.mark.parametrize("name, assigned, sizes, ended, chain", [
    ("b", {"a": 0, "b": 1}, [2, 2], {1}, 0),  # its chain ended for good: to one still running
    ("c", {"a": 0, "b": 0, "c": 1}, [2, 1], {1}, 0),  # the only one running, full: there as a spare
    ("d", {"a": 0, "b": 1, "c": 2, "d": 2}, [1, 1, 2], {2}, 0),  # fewest for their size among the running
    ("b", {"a": 0, "b": 1}, [2, 2], {0}, 1),  # another chain ended: a restarted stage keeps its own
    ("b", {"a": 0, "b": 1}, [1, 1], {0, 1}, 1),  # every chain ended: any will do (it waits at the door, which exits)
])
def test_a_stage_whose_chain_ended_joins_a_running_one(name, assigned, sizes, ended, chain):
    assert chain_for_stage(name, assigned, sizes, ended) == chain


@pytest.mark.parametrize("stage_knows, chain_bind, registers_at", [
    ("tcp://10.0.0.5:5555", "tcp://0.0.0.0:5557", "tcp://10.0.0.5:5557"),  # the host it reached, the chain's port
    ("tcp://broker-host:5555", "tcp://127.0.0.1:6001", "tcp://broker-host:6001"),
    ("tcp://[::1]:5555", "tcp://[::]:5557", "tcp://[::1]:5557"),
    ("ipc:///tmp/front", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"),  # no port to keep a host for
    ("tcp://10.0.0.5:5555", "ipc:///tmp/chain-1", "ipc:///tmp/chain-1"),
])
def test_a_redirect_keeps_the_host_the_stage_reached_and_takes_the_chains_port(stage_knows, chain_bind, registers_at):
    assert redirected_endpoint(stage_knows, redirect_header(chain_bind)) == registers_at


@pytest.mark.parametrize("header", [{}, {"port": "5557"}, {"port": True}, {"port": 70000}, {"endpoint": ""}])
def test_a_redirect_without_a_usable_address_is_refused(header):
    with pytest.raises(WireError, match="redirect"):
        redirected_endpoint("tcp://10.0.0.5:5555", header)


def fake_stage(context, address: str, name: str, **fields):
    stage = context.socket(zmq.DEALER)
    stage.setsockopt(zmq.IDENTITY, name.encode())
    stage.setsockopt(zmq.LINGER, 0)
    stage.connect(address)
    stage.send_multipart(encode({"kind": protocol.REGISTER, "name": name, "host": "box-a", **fields}))
    return stage


def answer(door: FrontDoor, stage) -> dict:
    for _ in range(50):
        door.serve(20)
        if stage.poll(20):
            message = decode(stage.recv_multipart(copy=False))
            return dict(message.header, kind=message.kind)
    raise AssertionError("the front door did not answer")


def test_the_front_door_holds_stages_until_their_chains_broker_listens_then_sends_each_on():
    context = zmq.Context()
    chains = [ChainDoor("chain 1", "tcp://0.0.0.0:6001", 1), ChainDoor("chain 2", "tcp://0.0.0.0:6003", 1)]
    door = FrontDoor(context, "tcp://127.0.0.1:*", chains)
    stages = []
    try:
        stages.append(fake_stage(context, door.address, "s0"))
        assert answer(door, stages[0])["kind"] == protocol.HEARTBEAT, "chain 1 does not listen yet: kept waiting"
        assert door.mark_ready(0) == ["stage s0 (host box-a) -> chain 1 at tcp://0.0.0.0:6001"]
        assert answer(door, stages[0]) == {"kind": protocol.REDIRECT, "port": 6001, "endpoint": "tcp://0.0.0.0:6001", "v": 1}
        door.mark_ready(1)
        stages.append(fake_stage(context, door.address, "s1"))
        assert answer(door, stages[1])["port"] == 6003, "chain 1 is full: the next stage goes to chain 2"
        stages[0].close()
        stages.append(fake_stage(context, door.address, "s0"))  # restarted under its name
        assert answer(door, stages[2])["port"] == 6001, "back to its own chain"
        assert door.assigned == {"s0": 0, "s1": 1} and door.waiting == {}
        door.mark_gone(1)  # chain 2's broker ended: its stage, restarted, waits until it listens again
        stages[1].close()
        stages.append(fake_stage(context, door.address, "s1"))
        assert answer(door, stages[3])["kind"] == protocol.HEARTBEAT
        assert door.mark_ready(1) == ["stage s1 (host box-a) -> chain 2 at tcp://0.0.0.0:6003"]
        assert answer(door, stages[3])["port"] == 6003
    finally:
        for stage in stages:
            stage.close(linger=0)
        door.close()
        context.term()


def test_a_survivor_its_chain_gave_up_goes_to_another_chain_even_before_the_chain_is_seen_to_end():
    """A chain that gives up sends its surviving stages back (redirect with release); the first of them can
    register here before the front door sees the chain's process end: it is never sent back to that chain.
    Stages that wait for a chain which then ends for good are sent on to the others."""
    context = zmq.Context()
    chains = [ChainDoor("chain 1", "tcp://0.0.0.0:6001", 2), ChainDoor("chain 2", "tcp://0.0.0.0:6003", 1)]
    door = FrontDoor(context, "tcp://127.0.0.1:*", chains, assigned={"s0": 0, "s1": 0, "s2": 1})
    stages = []
    try:
        door.mark_ready(0), door.mark_ready(1)
        stages.append(fake_stage(context, door.address, "s1", left_chain=True))  # chain 1 gave it up
        assert answer(door, stages[0])["port"] == 6003, "to chain 2, though chain 1 still looks ready"
        assert door.assigned["s1"] == 1
        door.mark_gone(1)  # chain 2's broker ended: a stage of it registering now waits for it ...
        stages.append(fake_stage(context, door.address, "s2"))
        assert answer(door, stages[1])["kind"] == protocol.HEARTBEAT
        # ... until it is known to have ended for good: then it goes to chain 1, still running.
        assert door.mark_ended(1) == ["stage s2 (host box-a) -> chain 1 at tcp://0.0.0.0:6001"]
        assert answer(door, stages[1])["port"] == 6001 and door.assigned["s2"] == 0
    finally:
        for stage in stages:
            stage.close(linger=0)
        door.close()
        context.term()


def test_each_chain_binds_two_ports_of_its_own_beside_the_front_doors():
    assert chain_binds("tcp://0.0.0.0:5555", "tcp://0.0.0.0:5556", None, 2) == [
        ("tcp://0.0.0.0:5557", "tcp://0.0.0.0:5558"), ("tcp://0.0.0.0:5559", "tcp://0.0.0.0:5560")]
    assert chain_binds("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", 7000, 3)[2] == (
        "tcp://127.0.0.1:7004", "tcp://127.0.0.1:7005")


@pytest.mark.parametrize("control, results, first, message", [
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5558", None, "own port 5558"),  # results inside the chains' range
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", 5554, "own port 5555"),
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", 65534, "past 65535"),
    ("ipc:///tmp/front", "tcp://127.0.0.1:5556", None, "--bind-control ipc:///tmp/front"),
])
def test_chain_ports_that_cannot_work_are_refused_with_the_way_out(control, results, first, message):
    with pytest.raises(UsageError, match=message) as refused:
        chain_binds(control, results, first, 2)
    assert "--chain-ports" in str(refused.value) or "tcp://HOST:PORT" in str(refused.value)


@pytest.mark.parametrize("code, serving, restarts, again", [
    (1, True, 0, True),  # a serving front door's chain failed: started again
    (-9, True, 0, True),  # killed (the OOM killer): started again
    (2, True, MAX_CHAIN_RESTARTS - 1, True),
    (1, True, MAX_CHAIN_RESTARTS, False),  # bounded
    (0, True, 0, False),  # ended cleanly
    (130, True, 0, False),  # Ctrl-C / SIGTERM, handled: stopping on purpose
    (143, True, 0, False),
    (1, False, 0, False),  # --job / --exit-when-idle: its exit code is its answer
    (EXIT_CHAIN_LEFT, True, 0, False),  # its stages broke: the survivors went on to the other chains
])
def test_restarts_chain(code, serving, restarts, again):
    assert restarts_chain(code, serving, restarts) is again


@pytest.mark.parametrize("codes, status", [
    ([0, 0], 0),
    ([0, 1], 1),  # the job did not complete on one chain
    ([2, 1], 2),  # the first failure
    ([0, -9], 137),  # a chain killed by SIGKILL, as a shell reports it
    ([143, 0], 143),
    ([EXIT_CHAIN_LEFT, 0], 0),  # a chain left the job to the other, which completed it
    ([0, EXIT_CHAIN_LEFT], 0),
    ([EXIT_CHAIN_LEFT, 1], 1),
    ([EXIT_CHAIN_LEFT, EXIT_CHAIN_LEFT], 1),  # nobody finished it
])
def test_front_door_exit(codes, status):
    assert front_door_exit(codes) == status


def test_a_chains_command_line_overrides_the_users_values_however_spelled():
    argv = ["broker", "--stages=4", "--chains=2", "--bind-control", "tcp://127.0.0.1:5555", "--poll", "0.5"]
    command = chain_command(argv, "chain 1", 2, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 2, Path("/run/chain-1.ready"),
                            "tcp://127.0.0.1:5555")
    assert command[1:3] == ["-m", "layerbus.cli.main"]
    args = build_parser(lambda name: name == "broker").parse_args(command[3:])
    assert (args.stages, args.chains, args.peer_brokers, args.poll) == (2, 1, 2, 0.5)
    assert (args.ready_file, args.chain_label) == (Path("/run/chain-1.ready"), "chain 1")
    assert (args.bind_control, args.bind_results) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert args.front_door == "tcp://127.0.0.1:5555"  # where it sends its surviving stages if it gives up


def test_chains_with_more_chains_than_stages_are_refused_before_anything_starts(tmp_path, capsys):
    assert cli_main(["broker", "--stages", "2", "--chains", "3", "--db", f"sqlite:///{tmp_path / 'jobs.db'}"]) == 2
    assert "--chains 3 with --stages 2" in capsys.readouterr().err
    assert not (tmp_path / "jobs.db").exists()


def test_chains_refuse_metrics_and_trace_which_serve_one_broker(tmp_path, capsys):
    assert cli_main(["broker", "--stages", "2", "--chains", "2", "--metrics", "127.0.0.1:0",
                     "--db", f"sqlite:///{tmp_path / 'jobs.db'}"]) == 2
    assert "--metrics and --trace serve one broker" in capsys.readouterr().err


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


@pytest.mark.cluster  # a front door, its chain brokers and two stage processes
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


@pytest.mark.cluster  # a front door and its two chain brokers, killed with real signals
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


@pytest.mark.cluster  # a front door, two chain brokers, three stage processes, one killed with SIGKILL
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
