"""PostgreSQL through libpq itself (ctypes), for the light commands' few queries.

Importing psycopg takes 90-180 ms of CPU here (it loads asyncio, importlib.metadata, typing_extensions
and its own adapters), more than the 100 ms a `layerbus status` may take in all; loading libpq, the C
library psycopg itself calls, takes about 8 ms. The light commands (storage/direct_db.py) send a handful
of parameterized statements and read back integers, text and timestamps, which is all this module does:
text-format parameters and results through `PQexecParams`, converted by the column's type OID the way
psycopg would for these types. Anything else (COPY, binary data, the broker's work) stays with
SQLAlchemy and psycopg.

Where libpq is found: the copy psycopg's binary wheel bundles (`psycopg_binary.libs/`), else the
system's `libpq.so.5`. Without either, `load_libpq` returns None and the caller uses psycopg.
"""

from __future__ import annotations

import ctypes
import os
from datetime import datetime
from typing import Any, Iterator

# Type OIDs (PostgreSQL's pg_type.dat) of the columns the light commands read, and how each is converted.
_INTEGER_OIDS = frozenset({20, 21, 23, 26})  # int8, int2, int4, oid
_FLOAT_OIDS = frozenset({700, 701})  # float4, float8
_NUMERIC_OID = 1700  # sum() of a bigint column is numeric
_BOOL_OID = 16
_TIMESTAMP_OIDS = frozenset({1114, 1184})  # timestamp, timestamptz (ISO text: DateStyle is set to ISO)
# PQresultStatus values that mean success.
_PGRES_COMMAND_OK = 1
_PGRES_TUPLES_OK = 2
_CONNECTION_OK = 0


class LibpqError(Exception):
    """A connection or statement that libpq reported as failed; the message is the server's or libpq's."""


def _bundled_libpq() -> str | None:
    """The libpq that psycopg's binary wheel ships, found without importing it (that is what costs)."""
    from importlib.util import find_spec

    try:
        spec = find_spec("psycopg_binary")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = os.path.join(os.path.dirname(next(iter(spec.submodule_search_locations))), "psycopg_binary.libs")
    try:
        names = sorted(name for name in os.listdir(libs) if name.startswith("libpq"))
    except OSError:
        return None
    return os.path.join(libs, names[0]) if names else None


_LIBRARY: ctypes.CDLL | None = None
_LOADED = False


def load_libpq() -> ctypes.CDLL | None:
    """libpq with the signatures this module calls, or None when neither copy can be loaded."""
    global _LIBRARY, _LOADED
    if _LOADED:
        return _LIBRARY
    _LOADED = True
    for candidate in (_bundled_libpq(), "libpq.so.5"):
        if candidate is None:
            continue
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        _declare(lib)
        _LIBRARY = lib
        break
    return _LIBRARY


def _declare(lib: ctypes.CDLL) -> None:
    pointer, text, integer = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    signatures: dict[str, tuple[list, Any]] = {
        "PQconnectdbParams": ([ctypes.POINTER(text), ctypes.POINTER(text), integer], pointer),
        "PQstatus": ([pointer], integer),
        "PQerrorMessage": ([pointer], text),
        "PQfinish": ([pointer], None),
        "PQexecParams": ([pointer, text, integer, pointer, ctypes.POINTER(text), pointer, pointer, integer], pointer),
        "PQresultStatus": ([pointer], integer),
        "PQresultErrorMessage": ([pointer], text),
        "PQntuples": ([pointer], integer),
        "PQnfields": ([pointer], integer),
        "PQftype": ([pointer, integer], ctypes.c_uint),
        "PQgetvalue": ([pointer, integer, integer], ctypes.c_void_p),
        "PQgetlength": ([pointer, integer, integer], integer),
        "PQgetisnull": ([pointer, integer, integer], integer),
        "PQcmdTuples": ([pointer], text),
        "PQclear": ([pointer], None),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype


def numbered_placeholders(query: str) -> str:
    """`?` marks as libpq's `$1, $2, ...` (no statement of the light commands holds a literal `?`)."""
    parts = query.split("?")
    return parts[0] + "".join(f"${number}{part}" for number, part in enumerate(parts[1:], start=1))


def parameter_text(value: object) -> bytes | None:
    """A parameter in PostgreSQL's text input format; None is SQL NULL. The server infers each type."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, datetime):
        return value.isoformat().encode()
    if isinstance(value, (int, float, str)):
        return str(value).encode()
    raise TypeError(f"cannot send a {type(value).__name__} as a libpq parameter: {value!r}")


def column_value(oid: int, text: str) -> object:
    """A result value from its text form, as psycopg returns these types (numeric as int when whole)."""
    if oid in _INTEGER_OIDS:
        return int(text)
    if oid in _FLOAT_OIDS:
        return float(text)
    if oid == _NUMERIC_OID:
        return int(text) if text.lstrip("-").isdigit() else float(text)
    if oid == _BOOL_OID:
        return text == "t"
    if oid in _TIMESTAMP_OIDS:
        return datetime.fromisoformat(text)
    return text


class Result:
    """The rows of one statement, read at once (the light commands' results are a few rows)."""

    def __init__(self, rows: list[tuple], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._rows)

    def fetchone(self) -> tuple | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[tuple]:
        return list(self._rows)


class Connection:
    """One libpq connection in autocommit mode (BEGIN/COMMIT are sent as statements), closed by `close`."""

    def __init__(self, lib: ctypes.CDLL, conninfo: str, connect_timeout_s: int) -> None:
        self._lib = lib
        self._conn = None
        # The URI is expanded (expand_dbname=1); the keywords after it override what it says, as psycopg's
        # keyword arguments do.
        keywords = [b"dbname", b"connect_timeout", b"client_encoding", None]
        values = [conninfo.encode(), str(connect_timeout_s).encode(), b"UTF8", None]
        self._conn = lib.PQconnectdbParams((ctypes.c_char_p * 4)(*keywords), (ctypes.c_char_p * 4)(*values), 1)
        if not self._conn:
            raise LibpqError("libpq could not allocate a connection (out of memory)")
        if lib.PQstatus(self._conn) != _CONNECTION_OK:
            message = (lib.PQerrorMessage(self._conn) or b"").decode("utf-8", "replace").strip()
            self.close()
            raise LibpqError(message or "libpq gave no reason")
        # Timestamps are parsed from ISO text whatever the server's or the user's DateStyle.
        self.execute("SET DateStyle TO ISO")

    def execute(self, query: str, params: tuple | list = ()) -> Result:
        lib = self._lib
        if self._conn is None:
            raise LibpqError("the connection is closed")
        values = (ctypes.c_char_p * max(len(params), 1))(*[parameter_text(value) for value in params])
        result = lib.PQexecParams(self._conn, numbered_placeholders(query).encode(), len(params), None, values,
                                  None, None, 0)
        if not result:
            raise LibpqError((lib.PQerrorMessage(self._conn) or b"").decode("utf-8", "replace").strip())
        try:
            status = lib.PQresultStatus(result)
            if status not in (_PGRES_COMMAND_OK, _PGRES_TUPLES_OK):
                message = (lib.PQresultErrorMessage(result) or b"").decode("utf-8", "replace").strip()
                raise LibpqError(message or f"libpq result status {status}")
            rows = self._rows(result) if status == _PGRES_TUPLES_OK else []
            affected = lib.PQcmdTuples(result) or b""
            return Result(rows, int(affected) if affected.isdigit() else -1)
        finally:
            lib.PQclear(result)

    def _rows(self, result: int) -> list[tuple]:
        lib = self._lib
        fields = range(lib.PQnfields(result))
        oids = [lib.PQftype(result, field) for field in fields]
        rows = []
        for row in range(lib.PQntuples(result)):
            values = []
            for field in fields:
                if lib.PQgetisnull(result, row, field):
                    values.append(None)
                    continue
                raw = ctypes.string_at(lib.PQgetvalue(result, row, field), lib.PQgetlength(result, row, field))
                values.append(column_value(oids[field], raw.decode("utf-8")))
            rows.append(tuple(values))
        return rows

    def close(self) -> None:
        if self._conn is not None:
            self._lib.PQfinish(self._conn)
            self._conn = None

    def __del__(self) -> None:
        self.close()
