"""`layerbus broker --stages N --chains K`: K chains of stages started by hand, behind one address.

This process is the front door (broker/front_door.py): it binds --bind-control, where every stage is
told to register, and sends each on to its chain. Each chain is a `layerbus broker` child process with
this command's own arguments and its own share of the stages (N // K, one more for the first N % K),
bound on two ports of its own: chain i on --chain-ports + 2i (its control) and + 2i + 1 (its results),
on this broker's hosts. The chains serve the store's jobs side by side, through the item leases, as
several `layerbus broker` processes on one job do; `layerbus status JOB` shows each.

A chain's broker that ends is marked gone at the front door (its stages that register again wait there);
behind a front door that serves until stopped (neither --job nor --exit-when-idle) a failed one is started
again, a few times (restarts_chain).

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
MAX_CHAIN_RESTARTS = 3  # a serving front door starts a failed chain's broker again this many times
RESTART_DELAY_S = 2.0


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


def restarts_chain(code: int, serving: bool, restarts: int) -> bool:
    """Whether a chain's broker that ended with exit `code` is started again: only behind a serving front door
    (neither --job nor --exit-when-idle: it serves jobs until stopped, and so should its chains), after a
    failure (not 0; not Ctrl-C or SIGTERM handled, 130 or 143; a SIGKILL is -9 and counts as one), at most
    MAX_CHAIN_RESTARTS times. A --job or --exit-when-idle chain's exit code is its answer."""
    return serving and code not in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM) and restarts < MAX_CHAIN_RESTARTS


def serve_chains(args: argparse.Namespace, keys, control_bind: str, results_bind: str) -> int:
    """Start every chain's broker, redirect the stages to them until all have ended; 0 iff every chain
    ended with 0 (for --job and --exit-when-idle: the job completed / every job completed)."""
    import zmq

    from layerbus.broker.front_door import ChainDoor, FrontDoor
    from layerbus.cli.signals import Interrupted, stop_on_signals
    from layerbus.jobs.chain_split import split_stages

    shares = split_stages(args.stages, args.chains)
    binds = chain_binds(control_bind, results_bind, args.chain_ports, args.chains)
    doors = [ChainDoor(share.label, control, share.count) for share, (control, _) in zip(shares, binds)]
    flags = Path(tempfile.mkdtemp(prefix="layerbus-chains-"))
    chains = [ChainProcess(chain_command(args.argv, share.label, share.count, control, results, args.chains,
                                         flags / f"chain-{share.index + 1}.ready"), share.label)
              for share, (control, results) in zip(shares, binds)]
    context = zmq.Context()
    try:
        door = FrontDoor(context, control_bind, doors, keys)
    except zmq.ZMQError as error:
        context.term()
        shutil.rmtree(flags, ignore_errors=True)
        raise UsageError(f"cannot bind {control_bind}: {error}; another broker may hold the port: pick another "
                         "with --bind-control") from None
    try:
        for chain in chains:
            chain.start()
        layout = "; ".join(f"{d.label}: {d.size} stage(s) at {d.control_bind}" for d in doors)
        _say(f"waiting for {args.stages} stage(s) at {door.address}, sent on to {args.chains} chains ({layout})")
        with stop_on_signals():
            return _redirect_until_done(door, chains, serving=not (args.job or args.exit_when_idle))
    except Interrupted as interrupted:
        _stop(chains, interrupted.signum)
        _say(f"{interrupted}: stopped every chain; items in flight requeued")
        return interrupted.exit_code
    finally:
        _stop(chains, signal.SIGTERM)
        door.close()
        context.term()
        shutil.rmtree(flags, ignore_errors=True)


class ChainProcess:
    """One chain's `layerbus broker` process: started (again) from its command line; `ready` once it listens.
    The broker asks Linux itself to be sent SIGTERM if this process dies (cli/broker_service.py)."""

    def __init__(self, command: list[str], label: str):
        self.command, self.label = command, label
        self.ready_file = Path(command[command.index("--ready-file") + 1])
        self.process: subprocess.Popen | None = None
        self.restarts, self.restart_at, self.exit_code = 0, None, None

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.process, self.restart_at, self.exit_code = subprocess.Popen(self.command), None, None

    @property
    def ready(self) -> bool:
        return self.process is not None and self.process.poll() is None and self.ready_file.exists()

    def ended(self) -> int | None:
        """Its exit code the first time it is seen ended, else None."""
        if self.process is None or self.exit_code is not None or self.process.poll() is None:
            return None
        self.exit_code = self.process.returncode
        return self.exit_code


def _redirect_until_done(door, chains: list[ChainProcess], serving: bool) -> int:
    while True:
        moved = door.serve(POLL_MS)
        for index, chain in enumerate(chains):
            if not door.ready[index] and chain.ready:
                moved += door.mark_ready(index)
        for line in moved:
            _say(line)
        for index, chain in enumerate(chains):
            code = chain.ended()
            if code is not None:
                door.mark_gone(index)  # its stages that register again wait here for it
                again = restarts_chain(code, serving, chain.restarts)
                running = sum(other.exit_code is None for other in chains)  # this one has its exit code now
                _say(f"{chain.label}'s broker ended with exit code {code}"
                     + (f"; starting it again in {RESTART_DELAY_S:.0f} s ({chain.restarts + 1} of "
                        f"{MAX_CHAIN_RESTARTS})" if again else "")
                     + (f"; {running} chain(s) still running" if running > 0 and not again else ""))
                if again:
                    chain.restarts += 1
                    chain.restart_at = time.monotonic() + RESTART_DELAY_S
            if chain.restart_at is not None and time.monotonic() >= chain.restart_at:
                chain.start()
        if all(chain.exit_code is not None and chain.restart_at is None for chain in chains):
            codes = [chain.exit_code for chain in chains]
            return EXIT_OK if all(code == 0 for code in codes) else next(code for code in codes if code != 0)


def _stop(chains: list[ChainProcess], signum: int) -> None:
    """Pass `signum` to every chain's broker still running, STOP_WAIT_S for them all, then kill the rest."""
    alive = [chain.process for chain in chains if chain.process is not None and chain.process.poll() is None]
    for process in alive:
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    for process in alive:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _say(text: str) -> None:
    print(f"layerbus broker: {text}", file=sys.stderr, flush=True)
