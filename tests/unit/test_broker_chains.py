"""`layerbus broker --stages N --chains K`: the front door's choices as table tests (which chain a stage
joins, where a redirect sends it, each chain's ports and command line, when a chain is started again), no
processes. tests/cluster/test_broker_chains.py runs the chains end to end."""

from __future__ import annotations

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
from layerbus.wire import protocol
from layerbus.wire.frames import WireError, decode, encode
from layerbus.wire.protocol import redirect_header, redirected_endpoint


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
