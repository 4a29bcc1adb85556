"""An evenly spread sample of a job's items, chosen in SQL (JobStore.sample_items).

The planner needs a job's mix of prompt lengths and output budgets, not every item: a job of a million
items is planned from a few thousand of them (jobs/job_workload.py). The items at storage.sample_places'
places in seq order are read: exactly min(count, total) items, one from each of `count` equal stretches,
and only those rows' wide columns (input and prompt, ~1.5 kB an item). A job's seqs usually run without
a gap (a refused line is an item too), and then the place p is the seq first + p: one index lookup per
item. Where they have gaps (blank lines of a JSON Lines file), the places are counted with row_number
over the (job_id, seq) index, which reads every entry of the job's there: ~1.2 s for a million on SQLite.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import BindParameter, Integer, Select, bindparam, func, select

from layerbus.storage.records import NewItem
from layerbus.planner.sample_places import sample_places
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


def sample_query(job_id: str, count: int, total: int, seqs: tuple[int, int]) -> Select:
    """The query of `count` items spread evenly over the `total` items of `job_id` (all of them when
    count >= total), whose seqs run from seqs[0] to seqs[1], in seq order: custom_id, input, prompt,
    params_json, seq."""
    columns = (ITEM.custom_id, ITEM.input, ITEM.prompt, ITEM.params_json, ITEM.seq)
    places = sample_places(count, total)
    if len(places) == total:
        return select(*columns).where(ITEM.job_id == job_id).order_by(ITEM.seq)
    first, last = seqs
    if last - first + 1 == total:  # no gap: the seq at place p is first + p
        kept_seqs = [first + p for p in places]
        return (select(*columns).where(ITEM.job_id == job_id, ITEM.seq.in_(_literal_ints("seqs", kept_seqs)))
                .order_by(ITEM.seq))
    position = (func.row_number().over(order_by=ITEM.seq) - 1).label("position")
    ranked = select(ITEM.seq, position).where(ITEM.job_id == job_id).subquery()
    kept = select(ranked.c.seq).where(ranked.c.position.in_(_literal_ints("places", places)))
    return select(*columns).where(ITEM.job_id == job_id, ITEM.seq.in_(kept)).order_by(ITEM.seq)


def _literal_ints(name: str, values: list[int]) -> BindParameter[int]:
    """An IN list written into the SQL text, not one parameter a value: SQLite takes at most 32,766
    parameters a statement, and these are integers we made."""
    return bindparam(name, values, type_=Integer, expanding=True, literal_execute=True)
