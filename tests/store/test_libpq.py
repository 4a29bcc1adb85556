"""storage/libpq.py: PostgreSQL through libpq by ctypes, for the light commands. Its conversions are table
tests; a real PostgreSQL server checks that values come back as psycopg returns them."""

from __future__ import annotations

from contextlib import closing
from datetime import datetime, timedelta, timezone

import pytest

from layerbus.storage.libpq import (Connection, LibpqError, column_value, load_libpq, numbered_placeholders,
                                    parameter_text)


@pytest.mark.parametrize(("query", "expected"), [
    ("SELECT 1", "SELECT 1"),
    ("SELECT a FROM t WHERE b = ?", "SELECT a FROM t WHERE b = $1"),
    ("UPDATE t SET a = ?, b = ? WHERE c IN (?, ?)", "UPDATE t SET a = $1, b = $2 WHERE c IN ($3, $4)"),
    ("?", "$1"),
])
def test_placeholders_are_numbered_in_order(query: str, expected: str) -> None:
    assert numbered_placeholders(query) == expected


@pytest.mark.parametrize(("value", "text"), [
    (None, None), (True, b"t"), (False, b"f"), (0, b"0"), (-12, b"-12"), (2.5, b"2.5"), ("héllo", "héllo".encode()),
    (datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=timezone.utc), b"2030-01-02T03:04:05.000006+00:00"),
])
def test_parameters_are_sent_in_text_form(value: object, text: bytes | None) -> None:
    assert parameter_text(value) == text


def test_a_parameter_of_another_type_is_refused_with_its_type() -> None:
    with pytest.raises(TypeError, match="bytes"):
        parameter_text(b"raw")


@pytest.mark.parametrize(("oid", "text", "value"), [
    (20, "9000000000", 9_000_000_000), (23, "-3", -3), (701, "0.25", 0.25), (1700, "42", 42), (1700, "1.5", 1.5),
    (16, "t", True), (16, "f", False), (25, "text", "text"),
    (1184, "2030-01-02 03:04:05.000006+00", datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=timezone.utc)),
    (1184, "2030-01-02 05:34:05+02:30", datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)),
    (1114, "2030-01-02 03:04:05", datetime(2030, 1, 2, 3, 4, 5)),
])
def test_results_are_converted_by_column_type(oid: int, text: str, value: object) -> None:
    assert column_value(oid, text) == value


@pytest.mark.postgres
def test_values_round_trip_through_a_real_server_as_psycopg_returns_them(postgres_fresh_url: str) -> None:
    import psycopg

    library = load_libpq()
    assert library is not None, "psycopg's binary wheel bundles libpq"
    target = "postgresql://" + postgres_fresh_url.split("://", 1)[1]
    stamp = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    with closing(Connection(library, target, 10)) as conn:
        conn.execute("SET TimeZone TO 'Asia/Kolkata'")  # a session zone other than UTC: values stay the instant
        conn.execute("CREATE TABLE t (id text PRIMARY KEY, n bigint, at timestamptz, note text, ok boolean)")
        inserted = conn.execute("INSERT INTO t VALUES (?, ?, ?, ?, ?), (?, ?, ?, ?, ?)",
                                ("a", 9_000_000_000, stamp, "ünï", True, "b", 1, None, None, False))
        assert inserted.rowcount == 2
        mine = conn.execute("SELECT id, n, at, note, ok FROM t ORDER BY id").fetchall()
        total = conn.execute("SELECT sum(n), count(*) FROM t WHERE id IN (?, ?)", ("a", "b")).fetchone()
        assert conn.execute("UPDATE t SET n = n + 1 WHERE id = ?", ("zzz",)).rowcount == 0
    with psycopg.connect(target) as reference:
        theirs = reference.execute("SELECT id, n, at, note, ok FROM t ORDER BY id").fetchall()
        their_total = reference.execute("SELECT sum(n), count(*) FROM t").fetchone()
    assert mine == theirs
    assert mine[0][2] == stamp and mine[0][2].utcoffset() == timedelta(hours=5, minutes=30)
    assert total == (int(their_total[0]), their_total[1]) == (9_000_000_001, 2)


@pytest.mark.postgres
def test_a_failed_statement_raises_the_servers_message_and_the_connection_carries_on(postgres_fresh_url: str) -> None:
    library = load_libpq()
    target = "postgresql://" + postgres_fresh_url.split("://", 1)[1]
    with closing(Connection(library, target, 10)) as conn:
        with pytest.raises(LibpqError, match='relation "missing" does not exist'):
            conn.execute("SELECT * FROM missing WHERE id = ?", ("x",))
        assert conn.execute("SELECT ?::int + 1", (41,)).fetchone() == (42,)


def test_an_unreachable_server_raises_libpqs_reason() -> None:
    import socket

    library = load_libpq()
    if library is None:
        pytest.skip("no libpq on this machine (psycopg's binary wheel is not installed)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(LibpqError, match="refused|failed"):
        Connection(library, f"postgresql://nobody@127.0.0.1:{port}/none", 5)
