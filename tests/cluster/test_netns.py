"""The emulated link (bench/netns.py): namespaces are made and removed, and tbf really limits the
rate between consecutive stage namespaces. Skips where namespaces cannot be made (not root, no ip)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.netns import StageNamespaces, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")

RECEIVER = """
import socket, sys
server = socket.socket(); server.bind((sys.argv[1], 7101)); server.listen(1)
print("listening", flush=True)
conn, _ = server.accept(); total = 0
while chunk := conn.recv(65536): total += len(chunk)
print(total, flush=True)
"""
SENDER = """
import socket, sys, time
client = socket.create_connection((sys.argv[1], 7101))
started = time.monotonic(); client.sendall(b"x" * int(sys.argv[2])); client.shutdown(socket.SHUT_WR)
client.recv(1); print(time.monotonic() - started)
"""


def namespaces() -> set[str]:
    return {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout.splitlines() if line.strip()}


def test_rate_limited_link_between_stage_namespaces():
    size = 1_000_000  # 8 Mbit: about 2 s at 4 Mbit/s
    with StageNamespaces(["lb5-ta", "lb5-tb"], rate_mbit=4.0) as net:
        assert {"lb5-ta", "lb5-tb"} <= namespaces()
        receiver = subprocess.Popen(net.command("lb5-tb", [sys.executable, "-c", RECEIVER, net.chain_address(1)]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout.readline().strip() == "listening"
            sent = subprocess.run(net.command("lb5-ta", [sys.executable, "-c", SENDER, net.chain_address(1),
                                                          str(size)]), capture_output=True, text=True, timeout=60)
            assert sent.returncode == 0, sent.stderr
            assert receiver.stdout.readline().strip() == str(size)
        finally:
            receiver.kill()
            receiver.wait()
        seconds = float(sent.stdout)
        # 8 Mbit at 4 Mbit/s is 2 s; the bucket's 32 KiB burst shaves a little off. Only the lower
        # bound proves the limit: load on the machine can slow the sender, never speed it past the link.
        assert seconds > 1.6, f"1 MB took {seconds:.2f} s over a 4 Mbit/s link: the rate limit is not applied"
    assert not {"lb5-ta", "lb5-tb"} & namespaces(), "namespaces are removed on exit"


def test_namespaces_are_removed_when_setup_fails():
    with pytest.raises(RuntimeError):
        with StageNamespaces(["lb5-tc", "bad/name"], rate_mbit=4):  # ip refuses the second name, mid-setup
            pass
    assert "lb5-tc" not in namespaces()
