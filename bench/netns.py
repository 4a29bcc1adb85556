"""Emulated links between machines: Linux network namespaces joined by veth pairs, rate-limited
with `tc qdisc ... tbf` (netem is not available here), for benchmarks and tests. Needs root and
`ip`/`tc`; `unavailable_reason()` says why not, so callers skip cleanly.

    with StageNamespaces(["lb5-a", "lb5-b"], rate_mbit=2.0) as net:
        net.command("lb5-a", [sys.executable, "-m", "layerbus.stages", ...])   # argv run inside lb5-a

Topology: the caller stays in its own namespace (the "host", where the broker runs); each stage
namespace gets an unlimited veth link to the host (10.77.<i+1>.1 host side, .2 stage side), and
consecutive stage namespaces a rate-limited link (10.77.<100+i>.1 / .2) that the data plane uses.
Only addresses inside these namespaces are used; everything is deleted on exit, also on failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    probe = "lb5-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def run_ip(*args: str, namespace: str | None = None) -> None:
    command = (["ip", "netns", "exec", namespace] if namespace else []) + list(args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class LinkShape:
    """A tbf rate limit, applied on both ends of a veth pair (each end shapes what it sends)."""

    rate_mbit: float  # Mbit/s
    burst_bytes: int = 32 * 1024  # token bucket depth: a few packets beyond the rate
    latency_ms: int = 400  # packets queue this long before tbf drops them (TCP then backs off)

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, got {self.rate_mbit}")

    def tc_args(self, device: str) -> list[str]:
        return ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{self.rate_mbit * 1000:.0f}kbit",
                "burst", str(self.burst_bytes), "latency", f"{self.latency_ms}ms"]


class StageNamespaces:
    """Namespaces for a chain of stages; see the module docstring for the addresses."""

    def __init__(self, names: list[str], rate_mbit: float | None = None, host_links: bool = True):
        self.names = list(names)
        self.shape = LinkShape(rate_mbit) if rate_mbit is not None else None
        # False: only the links between stage namespaces, nothing in the caller's namespace, so runs
        # with other namespace names never share an interface or an address with this one.
        self.host_links = host_links
        self.created: list[str] = []

    def host_address(self, i: int) -> str:
        """The host as stage namespace i reaches it."""
        return f"10.77.{i + 1}.1"

    def stage_address(self, i: int) -> str:
        """Stage namespace i as the host reaches it."""
        return f"10.77.{i + 1}.2"

    def chain_address(self, i: int) -> str:
        """Stage namespace i as the previous stage reaches it (over the rate-limited link)."""
        return f"10.77.{100 + i - 1}.2"

    def command(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", name, *argv]

    def __enter__(self) -> "StageNamespaces":
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        for i, name in enumerate(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # a leftover of a killed run
            run_ip("ip", "netns", "add", name)
            self.created.append(name)
            run_ip("ip", "link", "set", "lo", "up", namespace=name)
            if not self.host_links:
                continue
            host_end, stage_end = f"lb5h{i}", f"lb5s{i}"
            subprocess.run(["ip", "link", "del", host_end], capture_output=True)
            run_ip("ip", "link", "add", host_end, "type", "veth", "peer", "name", stage_end)
            run_ip("ip", "link", "set", stage_end, "netns", name)
            run_ip("ip", "addr", "add", f"{self.host_address(i)}/24", "dev", host_end)
            run_ip("ip", "link", "set", host_end, "up")
            run_ip("ip", "addr", "add", f"{self.stage_address(i)}/24", "dev", stage_end, namespace=name)
            run_ip("ip", "link", "set", stage_end, "up", namespace=name)
        for i in range(1, len(self.names)):
            left, right = f"lb5c{i}a", f"lb5c{i}b"
            run_ip("ip", "link", "add", left, "netns", self.names[i - 1], "type", "veth", "peer", "name", right,
                "netns", self.names[i])
            run_ip("ip", "addr", "add", f"10.77.{100 + i - 1}.1/24", "dev", left, namespace=self.names[i - 1])
            run_ip("ip", "addr", "add", f"{self.chain_address(i)}/24", "dev", right, namespace=self.names[i])
            run_ip("ip", "link", "set", left, "up", namespace=self.names[i - 1])
            run_ip("ip", "link", "set", right, "up", namespace=self.names[i])
            if self.shape is not None:
                run_ip(*self.shape.tc_args(left), namespace=self.names[i - 1])
                run_ip(*self.shape.tc_args(right), namespace=self.names[i])

    def close(self) -> None:
        """Delete the namespaces (their veth ends, and so the host ends, go with them)."""
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created = []


def stop_stages(processes) -> None:
    """Wait for stage processes the broker told to stop; kill any still running after 10 s."""
    for process in processes:
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
