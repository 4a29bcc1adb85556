"""An evenly spread sample of a job's items, chosen in SQL (JobStore.sample_items).

The planner needs a job's mix of prompt lengths and output budgets, not every item: a job of a million
items is planned from a few thousand of them (jobs/job_workload.py). The items are numbered by their
place in seq order (row_number over the (job_id, seq) index, so seqs with gaps, as line numbers have,
change nothing) and the places kept are the middles of `count` equal stretches, floor((2i + 1) total /
2 count) for i < count (broker.workload.sample_positions): exactly min(count, total) items. Only those
rows' wide columns (input and prompt, ~1.5 kB an item) are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import ColumnElement, Select, func, select

from layerbus.storage.records import NewItem
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
    if count < 1:
        raise ValueError(f"a sample needs at least 1 item, got count={count}")
    position = (func.row_number().over(order_by=ITEM.seq) - 1).label("position")
    ranked = select(ITEM.seq, position).where(ITEM.job_id == job_id).subquery()
    # Place p is a middle when an odd multiple of `total` lies in [2 count p, 2 count (p + 1)): the odd
    # multiples below x number (x + total - 1) // (2 total). There is at most one such multiple when
    # count <= total, and at least one when count >= total (every place is kept). Integer division on
    # both databases; row_number is a BIGINT on PostgreSQL, so the products cannot overflow.
    p = ranked.c.position
    kept = select(ranked.c.seq).where(_odd_multiples_below(2 * count * (p + 1), total)
                                      > _odd_multiples_below(2 * count * p, total))
    return (select(ITEM.custom_id, ITEM.input, ITEM.prompt, ITEM.params_json, ITEM.seq)
            .where(ITEM.job_id == job_id, ITEM.seq.in_(kept)).order_by(ITEM.seq))


def _odd_multiples_below(x: ColumnElement[int], total: int) -> ColumnElement[int]:
    """How many of total, 3 total, 5 total, ... are below x (x >= 0), as SQL."""
    return (x + total - 1) // (2 * total)
