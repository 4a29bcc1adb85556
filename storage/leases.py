"""Item leases: a claimed item is held by one worker until a time the worker keeps pushing forward.

A broker that dies stops renewing; once its leases run out any other broker may requeue its items
(rq's lease-expiry sweep). These are the lease's terms: how long one lasts, which items a holder holds
and which nobody does any more; storage/lease_store.py uses them in its transactions, and
storage/finalization.py for the finalizer's hold, a lease too.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, func, or_, select

from layerbus.storage.records import Lease
from layerbus.storage.schema import items as items_table

ITEM = items_table.c
# How long a claim holds an item without renewal. A live broker renews every few seconds, so this is
# how long a dead broker's items wait before another broker takes them over.
DEFAULT_LEASE_S = 60.0


def lease_end(now: datetime, lease_s: float) -> datetime:
    """When a lease of `lease_s` seconds taken or renewed at `now` runs out."""
    if not lease_s > 0:
        raise ValueError(f"lease of {lease_s!r} s: a lease must last a positive number of seconds (default "
                         f"{DEFAULT_LEASE_S:g}), several times the renewal interval")
    return now + timedelta(seconds=lease_s)


def held_by(holder: str) -> Any:
    """Items in flight for `holder`."""
    return (ITEM.status == "in_progress") & (ITEM.claimed_by == holder)


def reclaimable(now: datetime, holders: Sequence[str] = ()) -> Any:
    """In-flight items whose lease ran out (or that have none), or whose holder is one of `holders`."""
    condition = or_(ITEM.lease_expires_at.is_(None), ITEM.lease_expires_at < now)
    if holders:
        condition = or_(condition, ITEM.claimed_by.in_(list(holders)))
    return condition


def job_leases(conn: Connection, job_id: str) -> list[Lease]:
    """Each holder of the job's in-flight items, by holder name."""
    query = (
        select(ITEM.claimed_by, func.count(), func.count(ITEM.lease_expires_at), func.min(ITEM.lease_expires_at))
        .where(ITEM.job_id == job_id, ITEM.status == "in_progress")
        .group_by(ITEM.claimed_by)
        .order_by(ITEM.claimed_by)
    )
    return [Lease(holder or "", int(items), earliest if int(leased) == int(items) else None)
            for holder, items, leased, earliest in conn.execute(query)]
