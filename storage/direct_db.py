"""The store reached through its driver alone (sqlite3; libpq, else psycopg), without SQLAlchemy.

The light commands (`status`, `results`, `top`, `cancel`) answer in a few milliseconds of SQL, but
importing SQLAlchemy takes 130-240 ms here, ten times the rest of such a command, and importing psycopg
90-180 ms, so PostgreSQL is reached through libpq itself where it can be loaded (storage/libpq.py, about
8 ms). They use a DirectDb
where `direct_db` gives one, and the full JobStore otherwise: an unusual URL (a driver other than
psycopg, query options on a SQLite URL, an in-memory database), a missing SQLite file, or a missing
driver. What goes wrong past the connection (a store older than a table, a locked database) is for
the caller to answer from the full store, whose messages and migrations apply.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

from layerbus.storage.errors import StoreError, mask_url

# How long a SQLite writer waits for another process's write transaction before giving up (both paths:
# storage.engine sets it on the full store's connections).
SQLITE_BUSY_TIMEOUT_MS = 30_000
# How long connecting to a PostgreSQL server may take before the URL is reported unreachable (both paths).
POSTGRES_CONNECT_TIMEOUT_S = 10
# The one driver a PostgreSQL URL may name for this path: SQLAlchemy's plain postgresql:// means psycopg2.
_POSTGRES_PREFIX = "postgresql+psycopg://"
# What a read made through this path answers.
Answer = TypeVar("Answer")


def sqlite_file(url: str) -> Path | None:
    """The database file of a plain `sqlite:///path` URL (no driver, no query string), else None."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or "?" in url:
        return None
    path = unquote(url[len(prefix):])
    if not path or path == ":memory:":
        return None
    return Path(path).expanduser()


@dataclass(frozen=True)
class DirectDb:
    """One store as its driver reaches it. Queries are written with `?` marks; `sql` adapts them."""

    url: str
    # "sqlite" or "postgresql".
    kind: str
    # The SQLite file, or the libpq connection URI.
    target: str
    # "sqlite3", "libpq" (storage/libpq.py) or "psycopg": what `connect` opens.
    driver: str = "sqlite3"

    @property
    def error(self) -> type[Exception]:
        """The driver's base error class (what a query may raise)."""
        if self.driver == "sqlite3":
            return sqlite3.Error
        if self.driver == "libpq":
            from layerbus.storage.libpq import LibpqError

            return LibpqError
        import psycopg

        return psycopg.Error

    def sql(self, query: str) -> str:
        """`query`, written with `?` marks, in the driver's placeholders (no query of this path holds a
        literal ? or %)."""
        if self.driver == "libpq":
            from layerbus.storage.libpq import numbered_placeholders

            return numbered_placeholders(query)
        return query if self.driver == "sqlite3" else query.replace("?", "%s")

    def connect(self, write: bool = False):  # type: ignore[no-untyped-def]
        """A connection in autocommit mode (transactions are begun explicitly); read-only unless `write`.

        Closing it is the caller's (contextlib.closing): sqlite3's own `with` does not close.
        PostgreSQL connection failures raise StoreError worded as the full store words them.
        """
        if self.kind == "sqlite":
            mode = "rw" if write else "ro"
            conn = sqlite3.connect(f"file:{self.target}?mode={mode}", uri=True, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000,
                                   isolation_level=None)
            if write:
                conn.execute("PRAGMA foreign_keys = ON")  # as the full store's connections
            return conn
        if self.driver == "libpq":
            from layerbus.storage.libpq import Connection, LibpqError, load_libpq

            library = load_libpq()
            assert library is not None, "direct_db chose libpq, so it loaded"
            try:
                return Connection(library, self.target, POSTGRES_CONNECT_TIMEOUT_S)
            except LibpqError as exc:
                raise StoreError(postgres_connect_message(self.url, exc)) from exc
        import psycopg

        try:
            return psycopg.connect(self.target, autocommit=True, connect_timeout=POSTGRES_CONNECT_TIMEOUT_S)
        except psycopg.OperationalError as exc:
            raise StoreError(postgres_connect_message(self.url, exc)) from exc

    def has_table(self, conn, name: str) -> bool:  # type: ignore[no-untyped-def]
        if self.kind == "sqlite":
            query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
        else:
            query = "SELECT 1 FROM information_schema.tables WHERE table_schema = current_schema() AND table_name = ?"
        return conn.execute(self.sql(query), (name,)).fetchone() is not None

    def statements(self, conn):  # type: ignore[no-untyped-def]
        """How storage/light_sql.py runs its statements (`?` marks) on `conn`, a connection of this store."""
        return lambda query, params: conn.execute(self.sql(query), tuple(params))


def direct_db(url: str) -> DirectDb | None:
    """The DirectDb of `url`, or None when this path does not take it (the full JobStore does)."""
    path = sqlite_file(url)
    if path is not None:
        return DirectDb(url, "sqlite", str(path)) if path.is_file() else None
    if not url.startswith(_POSTGRES_PREFIX):
        return None
    # SQLAlchemy passes the URL's parts and query options to psycopg; libpq reads the same URI directly.
    target = "postgresql://" + url[len(_POSTGRES_PREFIX):]
    from layerbus.storage.libpq import load_libpq

    if load_libpq() is not None:
        return DirectDb(url, "postgresql", target, driver="libpq")
    try:
        import psycopg  # noqa: F401  (the postgres extra; without it the full store says what to install)
    except ImportError:
        return None
    return DirectDb(url, "postgresql", target, driver="psycopg")


def read_directly(url: str, read: Callable[[Callable[[str, Sequence[object]], Any]], Answer],
                  table: str | None = None) -> Answer | list | None:
    """What `read` answers on a read-only connection to `url`'s store; [] when the store has no `table` yet
    (a store older than it: a broker's JobStore.open adds it); None when this path cannot answer."""
    db = direct_db(url)
    if db is None:
        return None
    try:
        with closing(db.connect()) as conn:
            if table is not None and not db.has_table(conn, table):
                return []
            return read(db.statements(conn))
    except db.error:  # locked beyond the timeout, another schema, not a database: the full store decides
        return None


def postgres_connect_message(url: str, reason: object) -> str:
    """What a failed PostgreSQL connection says, on either path; `reason` is the driver's error (its first line
    is shown)."""
    lines = str(reason).strip().splitlines()
    reason = lines[0] if lines else "the driver gave no reason"
    return (f"cannot connect to {mask_url(url)!r}: {reason}; check that the server is running and reachable "
            "at that host and port, and that the user, password and database exist")
