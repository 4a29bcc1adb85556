"""Conversions between the store's records and table rows: item rows to insert, result updates,
claimed items, and naming the repeated value behind a failed insert."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, insert
from sqlalchemy.exc import IntegrityError

from layerbus.storage.records import ClaimedItem, InvalidItem, ItemResult, NewItem
from layerbus.storage.schema import items as items_table


def new_item_row(job_id: str, item: NewItem) -> dict[str, Any]:
    return {
        "job_id": job_id, "custom_id": item.custom_id, "seq": item.seq, "input": item.input,
        "prompt": item.prompt, "params_json": json.dumps(item.params, sort_keys=True), "status": item.status,
        "attempts": 0, "finish_reason": None, "error": None, "finished_at": None, **_part_fields(item),
    }  # fmt: skip


def _part_fields(item: NewItem) -> dict[str, Any]:
    return {"parent_id": item.parent_id, "position": item.position, "level": item.level, "combine": item.combine}


def is_part(item: NewItem) -> bool:
    """Whether the item is a part of a long document, or made from parts."""
    return item.parent_id is not None or item.combine is not None


# The columns a queued item is inserted with; the others start NULL.
_NEW_ITEM_COLUMNS = ("job_id", "custom_id", "seq", "input", "prompt", "params_json", "status", "attempts")


def insert_new_items(conn: Connection, job_id: str, items: Sequence[NewItem]) -> None:
    """Insert queued items the fastest way the driver has: PostgreSQL's COPY, SQLite's executemany on plain
    tuples. A million-item submit spent a third of its time in SQLAlchemy's per-row parameter handling, which
    these text and int values need not; on PostgreSQL, row-by-row INSERTs took the server three times as long."""
    parts = [new_item_row(job_id, item) for item in items if is_part(item)]
    if parts:  # a long document's parts: few beside the documents, inserted with their part columns
        conn.execute(insert(items_table), parts)
        items = [item for item in items if not is_part(item)]
    rows = [(job_id, item.custom_id, item.seq, item.input, item.prompt, _params_json(item.params), "queued", 0)
            for item in items]
    if not rows:
        return
    columns = ", ".join(_NEW_ITEM_COLUMNS)
    if conn.dialect.name == "postgresql":
        # The psycopg connection under this transaction: the COPY is part of it, and rolls back with it.
        statement = f"COPY items ({columns}) FROM STDIN"
        try:
            with conn.connection.driver_connection.cursor() as cursor:  # type: ignore[union-attr]
                with cursor.copy(statement) as copy:
                    for row in rows:
                        copy.write_row(row)
        except conn.dialect.dbapi.IntegrityError as exc:  # type: ignore[union-attr]
            raise IntegrityError(statement, None, exc) from exc  # as SQLAlchemy reports it for an INSERT
        return
    marks = ", ".join("?" * len(_NEW_ITEM_COLUMNS))
    conn.exec_driver_sql(f"INSERT INTO items ({columns}) VALUES ({marks})", rows)


def _params_json(params: dict[str, Any]) -> str:
    # Most items of a job share their params ({"add_special_tokens": false}): encode each kind once.
    # The key holds each value's type: 1, 1.0 and True are equal in Python but not in JSON.
    key = tuple((name, type(value), value) for name, value in sorted(params.items()))
    try:
        encoded = _ENCODED_PARAMS.get(key)
    except TypeError:  # a list value (stop strings) is not hashable: encode it
        return json.dumps(params, sort_keys=True)
    if encoded is None:
        encoded = json.dumps(params, sort_keys=True)
        if len(_ENCODED_PARAMS) < 1024:
            _ENCODED_PARAMS[key] = encoded
    return encoded


# params_json by the params' typed, sorted items, for the first kinds seen (bounded: per-item seeds would fill it).
_ENCODED_PARAMS: dict[tuple[tuple[str, type, Any], ...], str] = {}


def claimed_item(job_id: str, row: Any) -> ClaimedItem:
    """The ClaimedItem for an items row read just before the claim's UPDATE (so attempts is one behind)."""
    return ClaimedItem(
        item_id=row.id, job_id=job_id, custom_id=row.custom_id, seq=row.seq, input=row.input,
        prompt=row.prompt or "", params=json.loads(row.params_json), attempts=row.attempts + 1,
        parent_id=row.parent_id, combine=row.combine,
    )  # fmt: skip


def invalid_item_row(job_id: str, item: InvalidItem, now: datetime) -> dict[str, Any]:
    return {
        "job_id": job_id, "custom_id": item.custom_id, "seq": item.seq, "input": item.input,
        "prompt": None, "params_json": "{}", "status": "failed",
        "attempts": 0, "finish_reason": "error", "error": item.error, "finished_at": now,
        "parent_id": None, "position": None, "level": None, "combine": None,
    }  # fmt: skip


# What a NUL character of a generated text becomes on PostgreSQL, whose text columns cannot hold one.
NUL_STAND_IN = "\ufffd"


def result_params(result: ItemResult, no_nul: bool = False) -> dict[str, Any]:
    """The bind parameters that record `result`; `no_nul` (PostgreSQL) stores each NUL character of its
    output and error as U+FFFD: a model may well generate one (a byte-level token), and PostgreSQL refuses
    the whole batch of results for it ("text fields cannot contain NUL"), which failed the job."""
    output, error = result.output, result.error
    if no_nul:
        output, error = _without_nul(output), _without_nul(error)
    return {
        "b_id": result.item_id, "b_status": result.status,
        "b_output": output, "b_finish_reason": result.finish_reason,
        "b_prompt_tokens": result.prompt_tokens, "b_completion_tokens": result.completion_tokens,
        "b_latency_s": result.latency_s, "b_error": error, "b_logprobs": result.logprobs,
        # JSON text: a NUL of a sample's output is escaped there (\u0000), which PostgreSQL stores.
        "b_samples": result.samples,
    }  # fmt: skip


def _without_nul(text: str | None) -> str | None:
    return text.replace("\x00", NUL_STAND_IN) if text is not None and "\x00" in text else text


def duplicate_message(rows: list[dict[str, Any]], exc: IntegrityError) -> str:
    """Name the repeated custom_id or seq behind an IntegrityError, or fall back to the database's words."""
    for key in ("custom_id", "seq"):
        repeated = [value for value, n in Counter(row[key] for row in rows).items() if n > 1]
        if repeated:
            shown = ", ".join(repr(v) for v in repeated[:5])
            return (
                f"job not created: {key} {shown} appears more than once ({len(repeated)} repeated value(s)); "
                f"each item needs its own {key}: fix the input, nothing was queued"
            )
    return f"job not created, nothing was queued: {exc.orig}"
