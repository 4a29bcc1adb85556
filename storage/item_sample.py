"""An evenly spread sample of a job's items, chosen in SQL (JobStore.sample_items).

The planner needs a job's mix of prompt lengths and output budgets, not every item: a job of a million
items is planned from a few thousand of them (jobs/job_workload.py). The items are numbered by their
place in seq order (row_number over the (job_id, seq) index, so seqs with gaps, as line numbers have,
change nothing) and those at storage.sample_places' places are read: exactly min(count, total) items,
one from each of `count` equal stretches. Only those rows' wide columns (input and prompt, ~1.5 kB an
item) are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Integer, Select, bindparam, func, select

from layerbus.storage.records import NewItem
from layerbus.storage.sample_places import sample_places
from layerbus.storage.schema import items as items_table

ITEM = items_table.c


@dataclass(frozen=True)
class ItemSample:
    """Items of a job in seq order, and how many items the job has (refused ones included): each
    sampled item stands for total / len(items) of them."""

    items: tuple[NewItem, ...]
    total: int

    @property
    def whole(self) -> bool:
        """True when the sample is every item of the job."""
        return len(self.items) == self.total


def sample_query(job_id: str, count: int, total: int) -> Select:
    """The query of `count` items spread evenly over the `total` items of `job_id` (all of them when
    count >= total), in seq order: custom_id, input, prompt, params_json, seq."""
    columns = (ITEM.custom_id, ITEM.input, ITEM.prompt, ITEM.params_json, ITEM.seq)
    places = sample_places(count, total)
    if len(places) == total:
        return select(*columns).where(ITEM.job_id == job_id).order_by(ITEM.seq)
    position = (func.row_number().over(order_by=ITEM.seq) - 1).label("position")
    ranked = select(ITEM.seq, position).where(ITEM.job_id == job_id).subquery()
    # The places go in the SQL text (literal_execute), not as one parameter each: SQLite takes at most
    # 32,766 parameters a statement, and they are integers we made.
    kept = select(ranked.c.seq).where(
        ranked.c.position.in_(bindparam("places", places, type_=Integer, expanding=True, literal_execute=True)))
    return select(*columns).where(ITEM.job_id == job_id, ITEM.seq.in_(kept)).order_by(ITEM.seq)
