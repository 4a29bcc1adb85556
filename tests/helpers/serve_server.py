"""A real `layerbus serve` for tests: the console script on a free loopback port, waited on until it listens,
stopped with SIGTERM then SIGKILL; its log is shown when a wait fails. And the API keys a test makes for it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.cli import cli_env, layerbus, layerbus_executable
from tests.helpers.processes import free_ports

START_TIMEOUT_S = 60


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log: Path

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def alive(self) -> bool:
        return self.process.poll() is None

    def logs(self) -> str:
        return self.log.read_text()[-4000:]


def make_key(home: Path, db: str, name: str, *extra: str) -> str:
    made = layerbus(home, "keys", "api", "new", name, "--db", db, *extra)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


@contextmanager
def serve(home: Path, db: str, log: Path, *args: str) -> Iterator[RunningServer]:
    port = free_ports(1)
    with open(log, "w") as handle:
        process = subprocess.Popen([layerbus_executable(), "serve", "--db", db, "--bind", f"127.0.0.1:{port}", *args],
                                   env=cli_env(home), stdout=handle, stderr=subprocess.STDOUT)
    server = RunningServer(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "listening on" not in log.read_text():
            assert server.alive(), f"layerbus serve ended early:\n{server.logs()}"
            assert time.monotonic() < deadline, f"layerbus serve did not listen within {START_TIMEOUT_S} s:\n{server.logs()}"
            time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def raw_request(url: str, method: str = "GET", body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one request as sent, for what the openai client would never send."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")
