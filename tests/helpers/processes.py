"""For tests that start brokers and stages by hand: free ports to bind them to, waits that fail as soon as a
process ends early, showing the end of every log, and the processes a process started."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

TIMEOUT_S = 300  # how long wait_until waits


def logs_of(logs: Path) -> str:
    return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(logs.glob("*.log")))


def wait_until(condition, what: str, brokers: list[subprocess.Popen], logs: Path, allow_exit: bool = False) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert allow_exit or all(b.poll() is None for b in brokers), f"a broker ended early:\n{logs_of(logs)}"
        assert time.monotonic() < deadline, f"no {what} within {TIMEOUT_S} s:\n{logs_of(logs)}"
        time.sleep(0.1)


def free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 all free on loopback, below the kernel's ephemeral range: ports taken
    by binds to port 0 (every stage's data port, other tests' brokers) come from that range, so one of
    these could be taken between this check and the broker's bind if they were in it (a CI run lost a
    chain's broker so: 'Address already in use')."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(10000, max(10001, low - count))
        try:
            for port in range(first, first + count):
                with socket.socket() as check:
                    check.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} free consecutive ports below {low}")


def free_port_pair() -> int:
    """A port P with P and P+1 free (the broker binds control on P, results on P+1)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as second:
                second.bind(("0.0.0.0", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (its stages, and a launcher they were forked from), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
