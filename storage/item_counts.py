"""Per-job item counters: how many of a job's items are in each state, how many of those ever ran, and
their token sums, kept in `item_counts` by the transaction that moves the items.

`layerbus status` reads five rows per job from here instead of counting a million items. Every
JobStore method that changes an item's state records the change in a CountChanges and applies it
before committing; `recount` is the full count the counters must always equal (the contract suite
checks it, and a store from before the counters is filled from it when first opened).

The counters count items by their stored status, nothing else, so each writer changes them by exactly
the rows it changed and concurrent writers cannot make them drift. A cancel leaves the job's queued
items' rows untouched (rewriting a million wide rows took 15 s) and touches no counter: the job's
cancelling_at marks them, no claim hands them out, and status and results report them as cancelled
(storage.status.reported_aggregates for counters, storage/item_reads.py's result pages for rows). Moving
the queued counter into cancelled at the cancel would race a claim committing right after it (its item
rows changed, its counter change waiting on the cancel's row locks), leaving the queued counter negative
on PostgreSQL; the two-writer contract test checks the counters against a full count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import Connection, bindparam, case, func, insert, select, update

from layerbus.storage.schema import item_counts as counts_table
from layerbus.storage.schema import items as items_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.states import ITEM_STATES
from layerbus.storage.status import StateAggregate

COUNT = counts_table.c
ITEM = items_table.c
JOB = jobs_table.c
# The counted totals of a row, in StateAggregate's order after status.
_TOTALS = ("items", "ran", "prompt_tokens", "completion_tokens")


@dataclass
class CountChanges:
    """Counter changes made by one transaction, applied at its end in (job, state) order.

    The order matters on PostgreSQL: every writer locks counter rows in the same order (after the
    items, before the job row), so two transactions can never wait on each other's counter rows.
    """

    # (job_id, state) -> changes of [items, ran, prompt_tokens, completion_tokens].
    deltas: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def add(self, job_id: str, status: str, items: int, ran: int, prompt_tokens: int = 0,
            completion_tokens: int = 0) -> None:
        totals = self.deltas.setdefault((job_id, status), [0, 0, 0, 0])
        for i, value in enumerate((items, ran, prompt_tokens, completion_tokens)):
            totals[i] += value

    def move(self, job_id: str, source: str, target: str, items: int, ran: int) -> None:
        """`items` items (`ran` of them claimed before) leave `source` for `target`, tokens unchanged."""
        self.add(job_id, source, -items, -ran)
        self.add(job_id, target, items, ran)

    def apply(self, conn: Connection) -> None:
        params = [
            {"b_job": job_id, "b_status": status, **{f"b_{name}": value for name, value in zip(_TOTALS, totals)}}
            for (job_id, status), totals in sorted(self.deltas.items())
            if any(totals)
        ]
        if not params:
            return
        conn.execute(
            update(counts_table)
            .where(COUNT.job_id == bindparam("b_job"), COUNT.status == bindparam("b_status"))
            .values({name: COUNT[name] + bindparam(f"b_{name}") for name in _TOTALS}),
            params,
        )
        self.deltas.clear()


def insert_counts(conn: Connection, job_id: str, aggregates: Iterable[StateAggregate]) -> None:
    """The job's five counter rows: `aggregates` where given, zero for the other states."""
    given = {agg.status: agg for agg in aggregates}
    zero = StateAggregate("", 0, 0, 0, 0)
    rows = [
        {"job_id": job_id, "status": state, "items": agg.count, "ran": agg.ran,
         "prompt_tokens": agg.prompt_tokens, "completion_tokens": agg.completion_tokens}
        for state in ITEM_STATES
        for agg in [given.get(state, zero)]
    ]  # fmt: skip
    conn.execute(insert(counts_table), rows)


def read_counts(conn: Connection, job_ids: list[str]) -> dict[str, list[StateAggregate]]:
    """The counters of `job_ids`, per job; one indexed read of five rows per job."""
    if not job_ids:
        return {}
    query = select(COUNT.job_id, COUNT.status, *(COUNT[name] for name in _TOTALS)).where(COUNT.job_id.in_(job_ids))
    out: dict[str, list[StateAggregate]] = {}
    for job_id, status, *totals in conn.execute(query):
        out.setdefault(job_id, []).append(StateAggregate(status, *(int(t) for t in totals)))
    return out


def recount(conn: Connection, job_ids: list[str] | None = None) -> dict[str, list[StateAggregate]]:
    """The counters as a full count of the items by stored status would set them (all jobs when
    `job_ids` is None).

    Reads every item of the jobs: for filling the counters of an older store, and for checking them.
    """
    query = (
        select(
            ITEM.job_id, ITEM.status, func.count(), func.sum(case((ITEM.attempts > 0, 1), else_=0)),
            func.coalesce(func.sum(ITEM.prompt_tokens), 0), func.coalesce(func.sum(ITEM.completion_tokens), 0),
        )
        .group_by(ITEM.job_id, ITEM.status)
    )  # fmt: skip
    if job_ids is not None:
        query = query.where(ITEM.job_id.in_(job_ids))
    out: dict[str, list[StateAggregate]] = {}
    for job_id, state, *totals in conn.execute(query):
        out.setdefault(job_id, []).append(StateAggregate(state, *(int(t) for t in totals)))
    return out


def fill_missing_counts(conn: Connection) -> int:
    """Give every job without counters (made by a layerbus before them) its counters from a full count;
    how many jobs were filled. Runs once per store, where the tables are created."""
    missing = list(conn.execute(select(JOB.id).where(~JOB.id.in_(select(COUNT.job_id).distinct()))).scalars())
    for start in range(0, len(missing), 500):
        chunk = missing[start : start + 500]
        counted = recount(conn, chunk)
        for job_id in chunk:
            insert_counts(conn, job_id, counted.get(job_id, []))
    return len(missing)
