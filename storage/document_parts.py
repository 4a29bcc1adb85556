"""A long document's parts moving it on: when the last part of a waiting item finishes, the item moves in the
same transaction, so a kill between the two can never strand it and no two workers both move it.

A waiting item is made from its parts (jobs/long_documents.py): a reduce becomes queued (its prompt is
made from the parts' outputs when it is claimed), a join becomes completed with their outputs joined in
order, and either fails when a part failed. A join or a failure finishes the item, which may in turn be
the last part of its own parent: the moves go up the document's tree until one is still waiting.

Why the parent's row is locked before its parts are read: on PostgreSQL two workers may finish a
document's last two parts at once, each seeing the other's part still in flight. The second to lock the
parent waits for the first to commit, and its read of the parts (a new statement, read committed) then
sees both finished. SQLite runs one writer at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import Connection, select, update

from layerbus.storage.item_counts import CountChanges
from layerbus.storage.schema import items as items_table
from layerbus.storage.states import UNFINISHED_ITEM_STATES
from layerbus.storage.store_db import StoreDb, chunks

ITEM = items_table.c
# The text put between two joined parts when a part does not say (jobs/long_documents.py JOIN_BEFORE_KEY).
JOIN_BEFORE_KEY = "join_before"


def finished_parts(conn: Connection, item_ids: list[int]) -> list[tuple[int, str, str]]:
    """(level, job_id, parent_id) of those of the items that are parts of a long document."""
    found = []
    for chunk in chunks(item_ids):
        query = select(ITEM.level, ITEM.job_id, ITEM.parent_id).where(ITEM.id.in_(chunk), ITEM.parent_id.is_not(None))
        found += [(row.level or 0, row.job_id, row.parent_id) for row in conn.execute(query)]
    return found


def advance_parents(db: StoreDb, conn: Connection, finished: Iterable[tuple[int, str, str]], changes: CountChanges,
                    now: datetime) -> int:
    """Move each waiting parent of the finished parts ((level, job_id, parent_id)) whose parts are all
    finished; how many moved. Parents are locked level by level, in name order, so concurrent writers
    lock them in one order."""
    moved = 0
    frontier = sorted(set(finished))
    while frontier:
        level, job_id, parent_id = frontier.pop(0)
        moved_to = _advance(db, conn, job_id, parent_id, changes, now)
        if moved_to is None:
            continue
        moved += 1
        grandparent = moved_to[1]
        if moved_to[0] != "queued" and grandparent is not None:
            frontier = sorted(set(frontier) | {(level + 1, job_id, grandparent)})
    return moved


def _advance(db: StoreDb, conn: Connection, job_id: str, parent_id: str, changes: CountChanges,
             now: datetime) -> tuple[str, str | None] | None:
    """Move one waiting item whose parts are all finished: (its new state, its own parent); None if it
    waits on, or is not waiting."""
    query = select(ITEM.id, ITEM.status, ITEM.combine, ITEM.parent_id).where(
        ITEM.job_id == job_id, ITEM.custom_id == parent_id)
    parent = conn.execute(db.locking(query)).one_or_none()
    if parent is None or parent.status != "waiting":
        return None
    parts = conn.execute(
        select(ITEM.status, ITEM.output, ITEM.error, ITEM.finish_reason, ITEM.position, ITEM.params_json)
        .where(ITEM.job_id == job_id, ITEM.parent_id == parent_id).order_by(ITEM.position)
    ).all()
    if any(part.status in UNFINISHED_ITEM_STATES for part in parts):
        return None
    values = _result(parent.combine, parts)
    if values["status"] != "queued":
        values.update(finished_at=now)
    conn.execute(update(items_table).where(ITEM.id == parent.id, ITEM.status == "waiting").values(**values))
    changes.move(job_id, "waiting", values["status"], 1, 0)
    return values["status"], parent.parent_id


def _result(combine: str | None, parts: list) -> dict:
    """What a waiting item becomes from its finished parts (in order)."""
    unfinished = next((part for part in parts if part.status != "completed"), None)
    if unfinished is not None:
        why = unfinished.error or unfinished.status
        return {"status": "failed", "finish_reason": "error",
                "error": f"part {unfinished.position + 1} of {len(parts)} {unfinished.status}: {why}"}
    if combine != "join":
        return {"status": "queued"}
    texts = []
    for index, part in enumerate(parts):
        before = json.loads(part.params_json).get(JOIN_BEFORE_KEY, "\n\n") if index else ""
        texts.append(before + (part.output or ""))
    cut = any(part.finish_reason == "length" for part in parts)
    return {"status": "completed", "output": "".join(texts), "finish_reason": "length" if cut else "stop"}
