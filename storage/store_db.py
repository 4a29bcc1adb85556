"""The job store's database as each part of JobStore uses it: one transaction per call (read or write), row
locks where the dialect has them, storage/light_sql.py's statements run on SQLAlchemy's connection, and the
job lookup most calls start with."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, Select, select

from layerbus.storage.engine import READ_ONLY_OPTION
from layerbus.storage.errors import StoreError, mask_url
from layerbus.storage.light_sql import Run
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.signal_guard import guarded

JOB = jobs_table.c
# Rows per page when streaming results, and ids per IN (...) list (SQLite allows 32,766 parameters).
PAGE = 1000


class StoreDb:
    """One store's engine, shared by the parts of JobStore (storage/store.py)."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self._read_engine = engine.execution_options(**{READ_ONLY_OPTION: True})
        # "sqlite" or "postgresql".
        self.kind = engine.dialect.name
        # Only PostgreSQL needs (and understands) row locks; SQLite's BEGIN IMMEDIATE locks the database.
        self.row_locks = self.kind == "postgresql"
        # PostgreSQL's text columns cannot hold a NUL character; a generated one is stored as U+FFFD there.
        self.no_nul = self.kind == "postgresql"
        # The URL with its password masked, for messages.
        self.url = mask_url(url)
        # The driver's placeholder for light_sql's `?` marks: sqlite3 takes them as they are, psycopg wants %s.
        self._mark = "?" if engine.dialect.paramstyle == "qmark" else "%s"

    # Guarded: a Ctrl-C or SIGTERM that comes during a transaction is raised once it has closed
    # (storage/signal_guard.py says what an open one left behind).
    @contextmanager
    def write(self) -> Iterator[Connection]:
        with guarded(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with guarded(), self._read_engine.begin() as conn:
            yield conn

    def statements(self, conn: Connection) -> Run:
        """How light_sql's statements run on `conn`: through its driver, in its transaction."""
        mark = self._mark

        def run(query: str, params: Sequence[object]) -> Any:
            return conn.exec_driver_sql(query if mark == "?" else query.replace("?", mark), tuple(params))

        return run

    def locking(self, query: Select[Any], skip_locked: bool = False) -> Select[Any]:
        """`query` with FOR UPDATE on PostgreSQL (SKIP LOCKED if asked); as it is on SQLite."""
        return query.with_for_update(skip_locked=skip_locked) if self.row_locks else query

    def no_job(self, job_id: str) -> StoreError:
        return StoreError(f"no job {job_id!r} in {self.url}; `layerbus status` lists the jobs")

    def job_field(self, conn: Connection, job_id: str, column: Any) -> Any:
        """One column of the job's row; StoreError naming the job when there is no such job."""
        row = conn.execute(select(column).where(JOB.id == job_id)).one_or_none()
        if row is None:
            raise self.no_job(job_id)
        return row[0]


def chunks(values: list[int]) -> Iterator[list[int]]:
    """`values` in lists of at most PAGE, for IN (...) lists."""
    for start in range(0, len(values), PAGE):
        yield values[start : start + PAGE]
