"""Fixtures: a throwaway PostgreSQL server for the test session, and a fresh database per test.

The server is started from the PostgreSQL binaries found on this machine (PATH, `pg_config --bindir`,
/usr/lib/postgresql/*/bin), in a temporary folder, on a free port of 127.0.0.1. PostgreSQL refuses to
run as root, so under root the server runs as the `postgres` user (or `nobody`) via runuser.
Without the binaries the PostgreSQL tests are skipped, except when $CI is set: CI must test PostgreSQL.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Superuser created by initdb; trust authentication, so no password.
PG_USER = "layerbus"
# Seconds pg_ctl waits for the server to accept connections.
START_TIMEOUT_S = 60
# Speed over durability: the server and its data die with the test session.
_SERVER_OPTIONS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"


def find_postgres_bindir() -> Path | None:
    """The folder holding initdb and pg_ctl, or None when PostgreSQL's server binaries are not installed."""
    candidates: list[Path] = []
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).resolve().parent)
    pg_config = shutil.which("pg_config")
    if pg_config:
        done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if done.returncode == 0:
            candidates.append(Path(done.stdout.strip()))
    # Debian installs server binaries outside PATH, one folder per major version; prefer the newest.
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    candidates += [Path(p) for p in versions]
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    return None


def _server_user() -> str | None:
    """The user to run the server as: None for the current (non-root) user."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL as")


def _run_as(user: str | None, args: list[str], cwd: Path) -> None:
    command = args if user is None else ["runuser", "-u", user, "--", *args]
    # cwd: the server user may not be allowed into the test's working folder.
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed with exit code {done.returncode}:\n{done.stdout}\n{done.stderr}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _admin_sql(port: int, statement: str) -> None:
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=port, user=PG_USER, dbname="postgres", autocommit=True) as conn:
        conn.execute(statement)


class NoPostgres(RuntimeError):
    """PostgreSQL's server binaries are not installed here."""


@contextmanager
def throwaway_postgres() -> Iterator[int]:
    """A PostgreSQL server in a temporary folder for as long as the block lasts; yields its port on 127.0.0.1.
    NoPostgres when the binaries are missing (the bench's soak uses it too)."""
    bindir = find_postgres_bindir()
    if bindir is None:
        raise NoPostgres("PostgreSQL server binaries (initdb, pg_ctl) not found on PATH, via `pg_config --bindir` or "
                         "in /usr/lib/postgresql/*/bin; install them (Debian: apt-get install postgresql) to run the "
                         "PostgreSQL tests")
    user = _server_user()
    # Directly under /tmp: pytest's tmp folders are private to root, so the server user could not enter them.
    base = Path(tempfile.mkdtemp(prefix="layerbus-pg-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(base, entry.pw_uid, entry.pw_gid)
    data, log, port = base / "data", base / "server.log", _free_port()
    initdb = [str(bindir / "initdb"), "-D", str(data), "-U", PG_USER, "-A", "trust", "-E", "UTF8", "--no-sync"]
    _run_as(user, initdb, base)
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {base} {_SERVER_OPTIONS}"
    start = [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", str(START_TIMEOUT_S), "-o", options]
    try:
        _run_as(user, [*start, "start"], base)
        yield port
    finally:
        if (data / "postmaster.pid").exists():
            _run_as(user, [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], base)
        shutil.rmtree(base, ignore_errors=True)


def create_database(port: int, name: str) -> str:
    """A new database on the server at `port`; its postgresql+psycopg:// URL."""
    _admin_sql(port, f"CREATE DATABASE {name}")
    return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{port}/{name}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[int]:
    """Start a PostgreSQL server for the session; yields its port on 127.0.0.1."""
    try:
        with throwaway_postgres() as port:
            yield port
    except NoPostgres as missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing} ($CI is set, so PostgreSQL must be tested)")
        pytest.skip(str(missing))


@pytest.fixture(scope="session")
def postgres_url(postgres_server: int) -> str:
    """A postgresql+psycopg:// URL of a database on the session's throwaway server."""
    _admin_sql(postgres_server, "CREATE DATABASE layerbus_test")
    return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{postgres_server}/layerbus_test"


@pytest.fixture
def postgres_fresh_url(postgres_server: int) -> Iterator[str]:
    """A URL of a new, empty database for one test; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    _admin_sql(postgres_server, f"CREATE DATABASE {name}")
    yield f"postgresql+psycopg://{PG_USER}@127.0.0.1:{postgres_server}/{name}"
    _admin_sql(postgres_server, f"DROP DATABASE {name} WITH (FORCE)")
