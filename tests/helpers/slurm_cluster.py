"""A throwaway single-node Slurm cluster on this machine, for the sbatch recipe's test: munged, slurmctld and
slurmd started in the foreground (no systemd) from a temporary folder, every one stopped and the folder
removed on exit. Needs root and Debian's `slurm-wlm` and `munge`; `missing()` says why it cannot run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DAEMON_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel")
INSTALL = "apt-get install -y slurm-wlm munge"
READY_TIMEOUT_S = 60
# Slurm checks the node's CPU count against slurm.conf; config_overrides lets a 2-core machine offer more
# tasks than cores (a broker and two stages), which layerbus's stages share happily.
NODE_CPUS = 8


@dataclass(frozen=True)
class SlurmCluster:
    folder: Path  # slurm.conf, the daemons' logs, state and spool
    env: dict[str, str]  # what sbatch, srun and squeue need on top of the caller's environment: SLURM_CONF, PATH

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"== {path.name}\n{path.read_text(errors='replace')[-chars:]}"
                         for path in sorted(self.folder.glob("*.log")))


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "a Slurm cluster of our own needs root (slurmd starts the job's tasks)"
    absent = [name for name in PROGRAMS if shutil.which(name, path=DAEMON_PATH) is None]
    if absent:
        return f"no {', '.join(absent)}: install Debian's Slurm and munge ({INSTALL})"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_conf(folder: Path, node: str) -> str:
    return "\n".join([
        "ClusterName=layerbus-test",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={folder / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",  # no cgroups: a container may not delegate them
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN",
        f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@contextmanager
def single_node_slurm() -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd; yield once the node is idle; stop them and remove the folder."""
    folder = Path(tempfile.mkdtemp(prefix="layerbus-slurm-"))
    daemons: list[subprocess.Popen] = []
    try:
        for sub in ("munge", "state", "spool"):
            (folder / sub).mkdir(mode=0o755)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        node = socket.gethostname().split(".")[0]  # slurmd finds its NodeName by the short host name
        conf = folder / "slurm.conf"
        conf.write_text(slurm_conf(folder, node))
        env = {"SLURM_CONF": str(conf), "PATH": DAEMON_PATH}
        munge = folder / "munge"
        daemons.append(_start(["munged", "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
                               f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                               f"--seed-file={munge / 'munged.seed'}", f"--log-file={folder / 'munged.log'}"],
                              env, folder))
        _wait_for(lambda: (munge / "munge.socket").exists(), "munged's socket", folder)
        daemons.append(_start(["slurmctld", "-D", "-f", str(conf)], env, folder))
        daemons.append(_start(["slurmd", "-D", "-f", str(conf)], env, folder))
        cluster = SlurmCluster(folder, env)
        _wait_for(lambda: _node_state(env) == "idle", f"node {node} idle in sinfo", folder, daemons)
        try:
            yield cluster
        finally:
            _cancel_jobs(env)
    finally:
        for daemon in reversed(daemons):  # slurmd first: it ends its job steps while the others still listen
            daemon.terminate()
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _start(command: list[str], env: dict[str, str], folder: Path) -> subprocess.Popen:
    with open(folder / f"{command[0]}.out", "w") as out:
        return subprocess.Popen(command, env=_with_os(env), stdout=out, stderr=subprocess.STDOUT, cwd=folder)


def _with_os(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **env}


def _cancel_jobs(env: dict[str, str]) -> None:
    """Cancel what a failed test left running (a job's steps outlive slurmd), and wait until none is left."""
    subprocess.run(["scancel", "--user=root"], env=_with_os(env), capture_output=True, timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "--noheader"], env=_with_os(env), capture_output=True, text=True, timeout=10)
        if queue.returncode != 0 or not queue.stdout.strip():
            return
        time.sleep(0.5)


def _node_state(env: dict[str, str]) -> str:
    result = subprocess.run(["sinfo", "--noheader", "--format=%T"], env=_with_os(env), capture_output=True, text=True,
                            timeout=10)
    return result.stdout.strip()


def _wait_for(ready, what: str, folder: Path, daemons: list[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready():
        ended = [d.args[0] for d in daemons if d.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                             for p in sorted(folder.glob("*.log")) + sorted(folder.glob("*.out")))
            raise RuntimeError(f"no {what} within {READY_TIMEOUT_S} s (ended: {ended or 'none'}):\n{logs}")
        time.sleep(0.2)
