"""`layerbus broker --stages N --chains K`: K chains of stages started by hand, behind one address.

This process is the front door (launch/front_door.py): it binds --bind-control, where every stage is
told to register, and sends each on to its chain. Each chain is a `layerbus broker` child process with
this command's own arguments and its own share of the stages (N // K, one more for the first N % K),
bound on two ports of its own: chain i on --chain-ports + 2i (its control) and + 2i + 1 (its results),
on this broker's hosts. The chains serve the store's jobs side by side, through the item leases, as
several `layerbus broker` processes on one job do; `layerbus status JOB` shows each.

--chains auto: first a broker bound at the front door's own address waits for the N stages and profiles
them, the planner groups them (planner/chain_plan.py), and once each chain's broker listens that broker
sends its stages on to it; then it closes and the front door takes the address over.

A chain's broker that ends is marked gone at the front door (its stages that register again wait there);
behind a front door that serves until stopped (neither --job nor --exit-when-idle) a failed one is started
again, a few times (restarts_chain). A chain whose stages broke (one lost, and the rest cannot hold the
model) leaves its job to the others and sends its surviving stages back to the front door, spans dropped;
it is not started again, and the front door sends its stages on to the chains still running, whose
brokers put them to work mid-job where the plan gains by it (Broker.grow) or keep them as spares.

Child processes rather than one process driving K chains: launch/chains.py says why for `layerbus run
--chains K`, and it holds here too (each broker's Python work is its own, a fault stops one chain).
The front door runs no model.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from layerbus.launch.exits import EXIT_CHAIN_LEFT, EXIT_FAILED, EXIT_OK, RunFailed, UsageError
from layerbus.launch.process_life import ChildProcess, stop_children

if TYPE_CHECKING:
    from layerbus.broker.broker import Broker, BrokerConfig

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
                  ready_file: Path, front_door: str) -> list[str]:
    """The child broker's command line: this command's own arguments, then what differs for the chain.
    argparse keeps the last value of an option given twice, so the chain's values win however the user
    spelled theirs (abbreviated, or --opt=value). The broker creates `ready_file` once it listens, and
    sends its surviving stages back to `front_door` (the front door's bind) if it gives up."""
    return [sys.executable, "-m", "layerbus.cli.main", *argv, "--stages", str(size), "--chains", "1",
            "--bind-control", control_bind, "--bind-results", results_bind, "--peer-brokers", str(chains),
            "--ready-file", str(ready_file), "--chain-label", label, "--front-door", front_door]


def restarts_chain(code: int, serving: bool, restarts: int) -> bool:
    """Whether a chain's broker that ended with exit `code` is started again: only behind a serving front door
    (neither --job nor --exit-when-idle: it serves jobs until stopped, and so should its chains), after a
    failure (not 0; not Ctrl-C or SIGTERM handled, 130 or 143; a SIGKILL is -9 and counts as one), at most
    MAX_CHAIN_RESTARTS times. A --job or --exit-when-idle chain's exit code is its answer. A chain that left
    its job because its stages broke (EXIT_CHAIN_LEFT) is not: its broker is sound, and its surviving stages
    came back to the front door, which sends them on to the other chains."""
    stopped = (0, EXIT_CHAIN_LEFT, 128 + signal.SIGINT, 128 + signal.SIGTERM)
    return serving and code not in stopped and restarts < MAX_CHAIN_RESTARTS


def serve_chains(args: argparse.Namespace, keys, control_bind: str, results_bind: str,
                 profiler: "BrokerConfig | None" = None) -> int:
    """Start every chain's broker, redirect the stages to them until all have ended; 0 iff every chain
    ended with 0 (for --job and --exit-when-idle: the job completed / every job completed). With `profiler`
    (--chains auto) a broker of that config first waits for the stages at this address, profiles them, and
    the planner groups them; it sends each on to its chain itself."""
    import zmq

    from layerbus.launch.front_door import ChainDoor, FrontDoor
    from layerbus.launch.signals import Interrupted, stop_on_signals
    from layerbus.jobs.chain_split import split_stages

    flags = Path(tempfile.mkdtemp(prefix="layerbus-chains-"))
    chains: list[ChainProcess] = []
    profiling: Broker | None = None
    try:
        with stop_on_signals():
            if profiler is None:
                sizes, assigned = [share.count for share in split_stages(args.stages, args.chains)], {}
            else:
                from layerbus.broker.broker import Broker

                # A context of its own, terminated with it: its sockets' ports are free once term() returns,
                # for the front door to bind the same address (the shared instance would free them later).
                profiling_context = zmq.Context()
                profiling = Broker(profiler, context=profiling_context)
                sizes, assigned = _planned_groups(profiling, args.stages)
            binds = chain_binds(control_bind, results_bind, args.chain_ports, len(sizes))
            doors = [ChainDoor(f"chain {i + 1}", control, size) for i, (size, (control, _)) in enumerate(zip(sizes, binds))]
            chains = [ChainProcess(chain_command(args.argv, door.label, door.size, control, results, len(doors),
                                                 flags / f"chain-{i + 1}.ready", control_bind), door.label)
                      for i, (door, (control, results)) in enumerate(zip(doors, binds))]
            if profiling is not None:
                _hand_over(profiling, chains, doors, assigned)
                profiling.close()  # its address is the front door's now
                profiling_context.term()
                profiling = None
            context = zmq.Context()
            try:
                door = FrontDoor(context, control_bind, doors, keys, assigned=dict(assigned))
            except zmq.ZMQError as error:
                context.term()
                raise UsageError(f"cannot bind {control_bind}: {error}; another broker may hold the port: pick "
                                 "another with --bind-control") from None
            try:
                for chain in chains:
                    if chain.process is None:
                        chain.start()
                layout = "; ".join(f"{d.label}: {d.size} stage(s) at {d.control_bind}" for d in doors)
                _say(f"waiting for {args.stages} stage(s) at {door.address}, sent on to {len(doors)} chain(s) "
                     f"({layout})")
                return _redirect_until_done(door, chains, serving=not (args.job or args.exit_when_idle))
            finally:
                door.close()
                context.term()
    except Interrupted as interrupted:
        _stop(chains, interrupted.signum)
        _say(f"{interrupted}: stopped every chain; items in flight requeued")
        return interrupted.exit_code
    finally:
        if profiling is not None:
            profiling.close()  # tells the stages it profiled to stop, as any broker does on its way out
            profiling_context.term()
        _stop(chains, signal.SIGTERM)
        shutil.rmtree(flags, ignore_errors=True)


def _planned_groups(broker: "Broker", stages: int) -> tuple[list[int], dict[str, int]]:
    """--chains auto: the chains' sizes and which stage goes to which chain, from `broker` (bound at the front
    door's address), which waits for `stages` stages and profiles them as a broker placing them would; the
    planner groups them (planner/chain_plan.py)."""
    from layerbus.planner.chain_plan import plan_chains

    _say(f"--chains auto: waiting for {stages} stage(s) at {broker.address} to profile them")
    found = broker.control.wait_for_stages(stages, broker.config.register_timeout_s)
    broker.profile(found)
    plan = plan_chains(list(broker.profiles), broker.chain_planner(found))
    groups = [list(chain.order) + list(chain.left_out) for chain in plan.chosen.plans]
    single = f"; one chain of all: {plan.single.tokens_per_s:.1f}" if plan.single and len(groups) > 1 else ""
    _say(f"--chains auto: {len(groups)} chain(s) ({' | '.join(' -> '.join(g) for g in groups)}), "
         f"{plan.chosen.tokens_per_s:.1f} tok/s predicted{single}")
    return [len(group) for group in groups], {name: i for i, group in enumerate(groups) for name in group}


def _hand_over(broker: "Broker", chains: list["ChainProcess"], doors, assigned: dict[str, int]) -> None:
    """Start the chains' brokers; while they start, keep the profiled stages alive; once each listens, send its
    stages on to it (the caller then closes `broker`, whose stages are all handed over)."""
    for chain in chains:
        chain.start()
    waiting = set(range(len(chains)))
    while waiting:
        broker.keep_alive(0.2)
        for index in sorted(waiting):
            chain = chains[index]
            if chain.ended() is not None:
                raise RunFailed(f"{chain.label}'s broker ended with exit code {chain.exit_code} before it listened; "
                                "the stages are told to stop")
            if chain.ready:
                for stage in [s for s in broker.control.live_stages() if assigned.get(s.name) == index]:
                    broker.control.redirect(stage, doors[index].control_bind)
                    _say(f"stage {stage.name} (host {stage.host or '?'}) -> {doors[index].label} at "
                         f"{doors[index].control_bind}")
                waiting.discard(index)


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
                left = " (its stages broke: it left the job to the other chains)" if code == EXIT_CHAIN_LEFT else ""
                _say(f"{chain.label}'s broker ended with exit code {code}{left}"
                     + (f"; starting it again in {RESTART_DELAY_S:.0f} s ({chain.restarts + 1} of "
                        f"{MAX_CHAIN_RESTARTS})" if again else "")
                     + (f"; {running} chain(s) still running" if running > 0 and not again else ""))
                if again:
                    chain.restarts += 1
                    chain.restart_at = time.monotonic() + RESTART_DELAY_S
                elif running > 0:  # gone for good: its stages (the survivors it sends back) join the others
                    for line in door.mark_ended(index):
                        _say(line)
            if chain.restart_at is not None and time.monotonic() >= chain.restart_at:
                chain.start()
        if all(chain.exit_code is not None and chain.restart_at is None for chain in chains):
            return front_door_exit([chain.exit_code for chain in chains])


def front_door_exit(codes: list[int]) -> int:
    """The front door's exit status from its chains' (Popen's: -N for a chain killed by signal N): 0 iff every
    chain's was, else the first failure's, a killed chain's as a shell reports it (128 + N). A chain that left
    its job to the others (EXIT_CHAIN_LEFT) says nothing about the job: the others' codes do; 1 if every chain
    left (nobody finished it)."""
    answers = [code for code in codes if code != EXIT_CHAIN_LEFT]
    if not answers:
        return EXIT_FAILED
    failed = next((code for code in answers if code != 0), EXIT_OK)
    return 128 - failed if failed < 0 else failed


def _stop(chains: list[ChainProcess], signum: int) -> None:
    """Pass `signum` to every chain's broker still running, STOP_WAIT_S for them all, then kill the rest."""
    stop_children([ChildProcess(chain.process, chain.label) for chain in chains if chain.process is not None],
                  signum, STOP_WAIT_S)


def _say(text: str) -> None:
    print(f"layerbus broker: {text}", file=sys.stderr, flush=True)
