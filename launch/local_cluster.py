"""A broker in this process plus N stage processes on this machine: for `layerbus run`, tests and
benchmarks. The stage processes are forked from a launcher that imported their libraries once
(launch.stage_launcher; LAYERBUS_FORK_STAGES=0 starts each as a fresh interpreter instead). A stage
process that ends while the cluster starts is named with why and restarted a few times
(launch.stage_supervisor); one that cannot come back is left out and the model placed over the
others. Every process it starts is stopped on exit: SIGTERM, a bounded wait, then SIGKILL; and on
Linux the kernel sends them SIGTERM if this process dies without exiting (kill -9), so a killed broker
leaves no stages behind to compete with the one that resumes its job.

Secure by default: without keys in its config it makes a throwaway keypair for the run, shared by the
broker and its stages (wire.curve.ClusterKeys admits the broker's own key), in a temporary folder only
its user can read, deleted once the stages have registered and loaded (they hold the keys in memory)."""

from __future__ import annotations

import logging
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from layerbus.broker.broker import Broker, BrokerConfig
from layerbus.launch.process_life import die_with_parent
from layerbus.launch.stage_launcher import LauncherError, forking_supported, shared_launcher
from layerbus.launch.stage_supervisor import StageSupervisor
from layerbus.models.openmp_waits import with_passive_waits
from layerbus.wire.curve import ClusterKeys, make_keypair, read_keypair

log = logging.getLogger("layerbus.cluster")


@dataclass(frozen=True)
class LocalStageOptions:
    """How the local stage processes run."""

    threads_per_stage: int = 0  # 0 = share this machine's cores evenly between the stages
    device: str = "cpu"
    dtype: str = "float32"
    log_dir: Path | None = None  # one log file per stage (None = inherit this process's stderr)
    extra_args: tuple[str, ...] = ()  # passed to every `python -m layerbus.stages`
    stage_args: tuple[tuple[str, ...], ...] = ()  # passed to stage i only (e.g. --emulate-speed 0.33)
    env: dict[str, str] = field(default_factory=dict)  # added to each stage's environment
    # Restarts of a stage process that ends before the model is placed (a crash at start-up, a load that
    # runs out of memory); after that the run goes on without it, if the others can hold the model.
    max_restarts: int = 2
    # CURVE on every link with a throwaway keypair, unless the broker's config brings keys of its own.
    # False: links neither authenticated nor encrypted (all on loopback), for comparisons.
    secure: bool = True
    # Fork the stages from a launcher that imported their libraries once (launch.stage_launcher), where
    # the platform can; False: a fresh `python -m layerbus.stages` each (seconds of imports per stage).
    fork: bool = True
    # The first stage's overall index: stages are named stage-{first_stage + i} and log to stage-{...}.log,
    # so the chains of one `run --chains K` (one LocalCluster each) never share a stage's name or log.
    first_stage: int = 0


class LocalCluster:
    """`with LocalCluster(BrokerConfig(...)) as cluster: cluster.broker.generate(...)`."""

    def __init__(self, config: BrokerConfig, options: LocalStageOptions = LocalStageOptions()):
        self.config, self.options = config, options
        self.broker: Broker | None = None
        self.supervisor: StageSupervisor | None = None
        self.log_files = []
        self.key_dir: Path | None = None  # the throwaway keypair's folder, while the stages may still need it

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The stage processes, process i running stage-i (the latest one, after a restart)."""
        return self.supervisor.processes if self.supervisor is not None else []

    def __enter__(self) -> "LocalCluster":
        try:
            self.spawn()
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def start(self) -> None:
        """Start the broker (it places the model); stage processes that end after this are not restarted."""
        self.broker.start()
        self.supervisor.starting = False
        self._forget_keys()  # no stage process starts after this one

    def __exit__(self, *exc) -> None:
        self.close()

    def spawn(self) -> Broker:
        """The broker and the stage processes, without starting the broker (which places the model)."""
        if self.config.keys is None and self.options.secure:
            self.key_dir = Path(tempfile.mkdtemp(prefix="layerbus-keys-"))  # mode 700
            _, secret = make_keypair(self.key_dir, "run")
            self.config = replace(self.config, keys=ClusterKeys(read_keypair(secret)))
        self.broker = Broker(self.config)
        self._spawn_stages()
        return self.broker

    def _key_args(self) -> list[str]:
        """The stages' --keys and --broker-key: the broker's own keypair (it admits it)."""
        keys = self.config.keys
        return ["--keys", str(keys.keypair.path), "--broker-key", str(keys.keypair.path)] if keys else []

    def _forget_keys(self) -> None:
        if self.key_dir is not None:
            shutil.rmtree(self.key_dir, ignore_errors=True)
            self.key_dir = None

    def threads_per_stage(self) -> int:
        if self.options.threads_per_stage:
            return self.options.threads_per_stage
        return max(1, (os.cpu_count() or 1) // self.config.num_stages)

    def _spawn_stages(self) -> None:
        self.supervisor = StageSupervisor(self._spawn_stage, self._log_path, self.config.num_stages,
                                          self.options.max_restarts, first_stage=self.options.first_stage)
        self.broker.control.children = self.supervisor

    def _log_path(self, i: int) -> Path | None:
        name = self._stage_name(i)
        return self.options.log_dir / f"{name}.log" if self.options.log_dir is not None else None

    def _stage_name(self, i: int) -> str:
        return f"stage-{self.options.first_stage + i}"

    def _spawn_stage(self, i: int):
        """Stage process i: forked from the launcher where it can be, else a fresh interpreter."""
        argv = ["--broker", self.broker.address, "--name", self._stage_name(i),
                "--threads", str(self.threads_per_stage()), "--device", self.options.device,
                "--dtype", self.options.dtype, *self._key_args(), *self.options.extra_args,
                *(self.options.stage_args[i] if i < len(self.options.stage_args) else ())]
        env = with_passive_waits(dict(os.environ, **self.options.env))  # models/openmp_waits.py says why
        path = self._log_path(i)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        if self.options.fork and forking_supported():
            try:
                return shared_launcher().spawn(argv, env, path)
            except LauncherError as error:
                log.warning("%s; starting %s as a new process instead", error, self._stage_name(i))
        stderr = None
        if path is not None:
            stderr = open(path, "ab")
            self.log_files.append(stderr)
        # A new process group, so a Ctrl-C at the terminal reaches the broker alone and the
        # broker stops its stages in order.
        return subprocess.Popen([sys.executable, "-m", "layerbus.stages", *argv], env=env, stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True, preexec_fn=die_with_parent)

    def close(self, timeout_s: float = 10.0) -> None:
        if self.supervisor is not None:
            self.supervisor.starting = False  # stages told to stop are not restarted
        if self.broker is not None:
            try:
                self.broker.close()
            except Exception:  # closing must go on to stop the processes whatever happened
                log.exception("broker close failed")
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(3.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for handle in self.log_files:
            handle.close()
        self.supervisor, self.log_files = None, []
        self._forget_keys()

