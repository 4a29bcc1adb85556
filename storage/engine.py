"""Opening a database for the job store: where the default one lives, SQLite's transaction fixes,
PostgreSQL's connect timeout, and every way a URL can be wrong turned into a StoreError that says what to do."""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import Column, Connection, Engine, Table, create_engine, event, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

from layerbus.storage.direct_db import POSTGRES_CONNECT_TIMEOUT_S, SQLITE_BUSY_TIMEOUT_MS, postgres_connect_message
from layerbus.storage.errors import StoreError, mask_url
from layerbus.storage.locations import default_db_url, default_results_dir, layerbus_home  # noqa: F401 (re-exported)
from layerbus.storage.item_counts import fill_missing_counts
from layerbus.storage.schema import Base
from layerbus.storage.states import ITEM_STATES

# Execution option marking a transaction that only reads: on SQLite it begins DEFERRED, not IMMEDIATE.
READ_ONLY_OPTION = "layerbus_read_only"
# Arbitrary constant: the advisory lock that serializes concurrent table creation on PostgreSQL.
_CREATE_TABLES_LOCK = 0x6C617962  # "layb"

_URL_EXAMPLES = "sqlite:////abs/path/layerbus.db or postgresql+psycopg://user:password@host:5432/dbname"


def open_engine(url: str) -> Engine:
    """An Engine for `url` with layerbus's connection settings; raises StoreError for unusable URLs."""
    parsed = _parse(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        _make_sqlite_folder(parsed, url)
    elif backend != "postgresql":
        raise StoreError(
            f"database {mask_url(url)!r}: layerbus stores jobs in SQLite or PostgreSQL, not {backend!r}; "
            f"use {_URL_EXAMPLES}"
        )
    connect_args = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S} if backend == "postgresql" else {}
    try:
        engine = create_engine(parsed, connect_args=connect_args)
    except NoSuchModuleError as exc:
        raise StoreError(
            f"database {mask_url(url)!r}: unknown driver {parsed.drivername!r}; use {_URL_EXAMPLES}"
        ) from exc
    except ImportError as exc:
        raise StoreError(
            f"database {mask_url(url)!r}: its driver is not installed ({exc}); for PostgreSQL "
            "`pip install 'psycopg[binary]'` and use a postgresql+psycopg:// URL"
        ) from exc
    if backend == "sqlite":
        _use_sqlite_transactions(engine)
    return engine


def create_tables(engine: Engine, url: str) -> None:
    """Create the store's tables that are missing; connection failures become StoreError naming `url`.

    A store made by an older layerbus gains the tables added since (create_all skips existing ones),
    the columns added since to existing tables (nullable ones only, see missing_columns), and its jobs'
    item counters, counted from their items once (storage/item_counts.py).
    """
    try:
        # Most opens find the tables there: checking first spares SQLite a write lock per open.
        with engine.execution_options(**{READ_ONLY_OPTION: True}).connect() as conn:
            if _schema_is_current(conn):
                return
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                # Several workers may open a fresh database at once; CREATE TABLE is not idempotent under races.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CREATE_TABLES_LOCK})
            Base.metadata.create_all(conn)
            # Checked again inside the lock (BEGIN IMMEDIATE on SQLite): another opener may have added them.
            for table, column in missing_columns(conn):
                column_type = column.type.compile(dialect=conn.dialect)
                conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {column_type}"))
            admit_item_states(conn)
            conn.execute(text("CREATE INDEX IF NOT EXISTS items_job_parent ON items (job_id, parent_id)"))
            fill_missing_counts(conn)
    except DBAPIError as exc:
        raise _connect_error(engine, url, exc) from exc


def missing_columns(conn: Connection) -> list[tuple[Table, Column]]:
    """(table, column) of every column the schema has and an existing table lacks, in schema order.

    Only nullable columns without defaults may be added this way (ALTER TABLE ADD COLUMN fills old rows
    with NULL); a schema change that needs more must bring its own migration, and this says so.
    """
    inspector = inspect(conn)
    existing_tables = set(inspector.get_table_names())
    missing = []
    for table in Base.metadata.sorted_tables:
        if table.name not in existing_tables:
            continue
        present = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            if not column.nullable or column.server_default is not None or column.primary_key:
                raise StoreError(f"table {table.name} lacks column {column.name}, which cannot be added to "
                                 "existing rows as NULL; this layerbus needs a migration for it (a bug: report it)")
            missing.append((table, column))
    return missing


def _schema_is_current(conn: Connection) -> bool:
    inspector = inspect(conn)
    if not set(Base.metadata.tables) <= set(inspector.get_table_names()):
        return False
    if "items_job_parent" not in {index["name"] for index in inspector.get_indexes("items")}:
        return False  # made before long documents had parts: admit_item_states has its states to add
    return not missing_columns(conn)


def _item_states_check() -> str:
    return "status IN (" + ", ".join(f"'{state}'" for state in ITEM_STATES) + ")"


def admit_item_states(conn: Connection) -> None:
    """Widen the items table's check of its states to every state of ITEM_STATES, where a store made
    earlier checks fewer (the waiting state of a long document's parts).

    PostgreSQL replaces the constraint. SQLite cannot alter a constraint, and rebuilding the table would
    rewrite every row: the table's stored SQL is rewritten instead, which SQLite documents as the way to
    change a CHECK constraint (its "ALTER TABLE" page), as existing rows are valid under the wider check.
    """
    wanted = _item_states_check()
    if conn.dialect.name == "postgresql":
        current = conn.execute(text("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = "
                                    "'items_status_valid'")).scalar()
        if current is not None and "'waiting'" not in current:
            conn.execute(text(f"ALTER TABLE items DROP CONSTRAINT items_status_valid, ADD CONSTRAINT "
                              f"items_status_valid CHECK ({wanted})"))
        return
    table_sql = conn.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'items'").scalar()
    found = re.search(r"status IN \([^)]*\)", table_sql or "")
    if found is None or "'waiting'" in found.group(0):
        return
    version = conn.exec_driver_sql("PRAGMA schema_version").scalar()
    conn.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        conn.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'items'",
                             (table_sql.replace(found.group(0), wanted),))
        conn.exec_driver_sql(f"PRAGMA schema_version = {int(version) + 1}")
    finally:
        conn.exec_driver_sql("PRAGMA writable_schema = OFF")


def _parse(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError as exc:
        raise StoreError(f"cannot read database URL {mask_url(url)!r}; use {_URL_EXAMPLES}") from exc


def _make_sqlite_folder(parsed: URL, url: str) -> None:
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return
    folder = Path(database).expanduser().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot create the folder {str(folder)!r} for SQLite database {mask_url(url)!r}: {exc.strerror}; "
            "pass a URL whose folder is writable, or omit the database URL to use the default store "
            "under $LAYERBUS_HOME"
        ) from exc


def _connect_error(engine: Engine, url: str, exc: DBAPIError) -> StoreError:
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
    if engine.dialect.name == "sqlite":
        return StoreError(
            f"cannot open SQLite database {mask_url(url)!r}: {reason}; check that the path is a file "
            "(not a folder) in a writable folder, or omit the database URL to use the default store "
            "under $LAYERBUS_HOME"
        )
    return StoreError(postgres_connect_message(url, reason))


def _use_sqlite_transactions(engine: Engine) -> None:
    """Make pysqlite run real transactions: writes take the write lock at BEGIN (BEGIN IMMEDIATE).

    pysqlite's legacy mode starts transactions lazily and never for SELECT, so a claim's SELECT and
    UPDATE would not be atomic. SQLAlchemy's documented recipe: turn pysqlite's BEGIN off, emit our own.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        # WAL: readers (status calls) never block the claiming writer and vice versa.
        cursor.execute("PRAGMA journal_mode = WAL")
        # Under WAL, NORMAL survives process crashes; a power cut may lose the last commits, which
        # only means re-running those items.
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # IMMEDIATE takes the write lock up front: two claimers can never both read the same queued rows
        # and then fail to upgrade to writing (SQLITE_BUSY mid-transaction, which busy_timeout cannot wait out).
        read_only = conn.get_execution_options().get(READ_ONLY_OPTION, False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
