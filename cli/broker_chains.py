"""`layerbus broker --stages N --chains K`: K chains of stages started by hand, behind one address.

This process is the front door (broker/front_door.py): it binds --bind-control, where every stage is
told to register, and sends each on to its chain. Each chain is a `layerbus broker` child process with
this command's own arguments and its own share of the stages (N // K, one more for the first N % K),
bound on two ports of its own: chain i on --chain-ports + 2i (its control) and + 2i + 1 (its results),
on this broker's hosts. The chains serve the store's jobs side by side, through the item leases, as
several `layerbus broker` processes on one job do; `layerbus status JOB` shows each.

Child processes rather than one process driving K chains: cli/chains.py says why for `layerbus run
--chains K`, and it holds here too (each broker's Python work is its own, a fault stops one chain).
The front door runs no model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from layerbus.cli.errors import EXIT_FAILED, EXIT_OK, UsageError

STOP_WAIT_S = 60.0  # after a signal: how long each chain's broker may take to requeue and stop its stages
POLL_MS = 500


def chain_binds(control_bind: str, results_bind: str, first_port: int | None, chains: int) -> list[tuple[str, str]]:
    """(control, results) bind of each chain's broker: on the hosts of this broker's own binds, chain i on
    ports first_port + 2i and + 2i + 1 (default first_port: the control bind's port + 2)."""
    control_host, control_port = _tcp_host_port(control_bind, "--bind-control")
    results_host, _ = _tcp_host_port(results_bind, "--bind-results")
    first = first_port if first_port is not None else control_port + 2
    if first < 1 or first + 2 * chains - 1 > 65535:
        raise UsageError(f"--chain-ports {first}: chains need ports {first} to {first + 2 * chains - 1}, which is "
                         f"past 65535; give --chain-ports a lower first port")
    binds = [(f"tcp://{control_host}:{first + 2 * i}", f"tcp://{results_host}:{first + 2 * i + 1}") for i in range(chains)]
    taken = {_tcp_host_port(bind, "")[1] for bind in (control_bind, results_bind)}
    clash = sorted(taken & {first + k for k in range(2 * chains)})
    if clash:
        raise UsageError(f"--chains {chains}: the chains' ports {first} to {first + 2 * chains - 1} include this "
                         f"broker's own port {clash[0]}: give --chain-ports a first port outside them")
    return binds


def _tcp_host_port(bind: str, option: str) -> tuple[str, int]:
    prefix, _, port = bind.rpartition(":")
    if not bind.startswith("tcp://") or not port.isdigit():
        raise UsageError(f"{option} {bind}: --chains K needs tcp://HOST:PORT binds, so that each chain gets ports "
                         "of its own beside them")
    return prefix.removeprefix("tcp://"), int(port)


def chain_command(argv: list[str], label: str, size: int, control_bind: str, results_bind: str, chains: int,
                  ready_file: Path) -> list[str]:
    """The child broker's command line: this command's own arguments, then what differs for the chain.
    argparse keeps the last value of an option given twice, so the chain's values win however the user
    spelled theirs (abbreviated, or --opt=value). The broker creates `ready_file` once it listens."""
    return [sys.executable, "-m", "layerbus.cli.main", *argv, "--stages", str(size), "--chains", "1",
            "--bind-control", control_bind, "--bind-results", results_bind, "--peer-brokers", str(chains),
            "--ready-file", str(ready_file), "--chain-label", label]


def serve_chains(args: argparse.Namespace, keys, control_bind: str, results_bind: str) -> int:
    """Start every chain's broker, redirect the stages to them until all have ended; 0 iff every chain
    ended with 0 (for --job and --exit-when-idle: the job completed / every job completed)."""
    import zmq

    from layerbus.broker.front_door import ChainDoor, FrontDoor
    from layerbus.broker.stage_launcher import die_with_parent
    from layerbus.cli.signals import Interrupted, stop_on_signals
    from layerbus.jobs.chain_split import split_stages

    shares = split_stages(args.stages, args.chains)
    binds = chain_binds(control_bind, results_bind, args.chain_ports, args.chains)
    doors = [ChainDoor(share.label, control, share.count) for share, (control, _) in zip(shares, binds)]
    # The chains first: preexec_fn is safe only before this process has threads (the front door's ZeroMQ
    # context and CURVE authenticator start some). A chain's broker gets SIGTERM if this process dies.
    flags = Path(tempfile.mkdtemp(prefix="layerbus-chains-"))
    ready_files = [flags / f"chain-{share.index + 1}.ready" for share in shares]
    children = [subprocess.Popen(chain_command(args.argv, share.label, share.count, control, results, args.chains, ready),
                                 preexec_fn=die_with_parent)
                for share, (control, results), ready in zip(shares, binds, ready_files)]
    context = zmq.Context()
    try:
        door = FrontDoor(context, control_bind, doors, keys)
    except zmq.ZMQError as error:
        _stop(children, signal.SIGTERM)
        context.term()
        raise UsageError(f"cannot bind {control_bind}: {error}; another broker may hold the port: pick another "
                         "with --bind-control") from None
    try:
        layout = "; ".join(f"{d.label}: {d.size} stage(s) at {d.control_bind}" for d in doors)
        print(f"layerbus broker: waiting for {args.stages} stage(s) at {door.address}, sent on to {args.chains} chains "
              f"({layout})", file=sys.stderr, flush=True)
        with stop_on_signals():
            return _redirect_until_done(door, children, doors, ready_files)
    except Interrupted as interrupted:
        _stop(children, interrupted.signum)
        print(f"layerbus broker: {interrupted}: stopped every chain; items in flight requeued", file=sys.stderr)
        return interrupted.exit_code
    finally:
        _stop(children, signal.SIGTERM)
        door.close()
        context.term()
        shutil.rmtree(flags, ignore_errors=True)


def _redirect_until_done(door, children: list[subprocess.Popen], doors, ready_files: list[Path]) -> int:
    ended: dict[int, int] = {}
    while len(ended) < len(children):
        moved = door.serve(POLL_MS)
        for index, ready in enumerate(ready_files):
            if not door.ready[index] and ready.exists():
                moved += door.mark_ready(index)
        for line in moved:
            print(f"layerbus broker: {line}", file=sys.stderr, flush=True)
        for index, child in enumerate(children):
            if index not in ended and child.poll() is not None:
                ended[index] = child.returncode
                print(f"layerbus broker: {doors[index].label}'s broker ended with exit code {child.returncode}"
                      + (f"; {len(children) - len(ended)} chain(s) still running" if len(ended) < len(children) else ""),
                      file=sys.stderr, flush=True)
    return EXIT_OK if all(code == 0 for code in ended.values()) else next(
        (code for code in ended.values() if code != 0), EXIT_FAILED)


def _stop(children: list[subprocess.Popen], signum: int) -> None:
    """Pass `signum` to every chain's broker still running, STOP_WAIT_S for them all, then kill the rest."""
    alive = [child for child in children if child.poll() is None]
    for child in alive:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    for child in alive:
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
