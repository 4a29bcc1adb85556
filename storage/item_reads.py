"""Reading a job's items: its finished results (what the final Parquet file is built from), its items as they
were queued, and an even sample of them for the planner. Large jobs are read in pages, each page its own
short transaction."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy import func, select

from layerbus.storage.item_sample import ItemSample, sample_query
from layerbus.storage.records import NewItem
from layerbus.storage.result_row import RESULT_COLUMNS, expand_samples
from layerbus.storage.schema import items as items_table
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.states import FINISHED_ITEM_STATES
from layerbus.storage.store_db import PAGE, StoreDb

ITEM = items_table.c
JOB = jobs_table.c


class ItemReads:
    """JobStore's item_results, job_items and sample_items."""

    def __init__(self, db: StoreDb) -> None:
        self._db = db

    def item_results(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Finished items (completed, failed, cancelled) of a job in seq order, as result rows.

        Keys: custom_id, seq, input, output, finish_reason, prompt_tokens, completion_tokens,
        latency_s, error, status, logprobs, sample_index: one row per sample of an item asked for n > 1
        samples (jobs/samples.py), each with its own output, finish_reason, completion_tokens, ... Read in pages,
        each its own short transaction.
        """
        with self._db.read() as conn:
            cancelled_at = self._db.job_field(conn, job_id, JOB.cancelling_at)
        return self._result_pages(job_id, cancelled=cancelled_at is not None)

    def job_items(self, job_id: str) -> Iterator[NewItem]:
        """Every item of a job as it was queued (custom_id, input, prompt, params, seq), in seq order.
        Items refused at submit have no prompt; they come back with prompt "". Read in pages."""
        with self._db.read() as conn:
            self._db.job_field(conn, job_id, JOB.id)
        last_seq: int | None = None
        while True:
            query = select(ITEM.custom_id, ITEM.input, ITEM.prompt, ITEM.params_json, ITEM.seq).where(
                ITEM.job_id == job_id)
            if last_seq is not None:
                query = query.where(ITEM.seq > last_seq)
            with self._db.read() as conn:
                page = conn.execute(query.order_by(ITEM.seq).limit(PAGE)).all()
            yield from (_as_queued(row) for row in page)
            if len(page) < PAGE:
                return
            last_seq = page[-1].seq

    def part_outputs(self, job_id: str, parent_id: str) -> list[str]:
        """The outputs of the parts of a long document's item, in their order (storage/document_parts.py):
        what its reduce prompt is made from."""
        query = (select(ITEM.output).where(ITEM.job_id == job_id, ITEM.parent_id == parent_id)
                 .order_by(ITEM.position))
        with self._db.read() as conn:
            return [output or "" for output in conn.execute(query).scalars()]

    def sample_items(self, job_id: str, count: int) -> ItemSample:
        """At most `count` items of a job as it was queued, spread evenly over it in seq order (all of
        them when it has no more), and how many it has: what the planner reads of a job too large to
        read whole (storage/item_sample.py). Only the sampled rows' columns are read."""
        with self._db.read() as conn:
            total = int(self._db.job_field(conn, job_id, JOB.total_count))
            # Two subqueries, not min and max in one select: SQLite reads only the index's ends for a lone
            # min() or max(), and every entry of the job's for both (0.3 s for a million).
            first, last = (select(end(ITEM.seq)).where(ITEM.job_id == job_id).scalar_subquery()
                           for end in (func.min, func.max))
            seqs = conn.execute(select(first, last)).one()
            rows = conn.execute(sample_query(job_id, count, total, tuple(seqs))).all() if total else []
        return ItemSample(tuple(_as_queued(row) for row in rows), total)

    def _result_pages(self, job_id: str, cancelled: bool) -> Iterator[dict[str, Any]]:
        """Result rows in seq order, one per sample (an item of n samples gives n rows, sample_index 0 to n-1);
        with `cancelled` (the job was cancelled), its still-queued items too, as the cancelled items they are
        (storage/item_counts.py)."""
        columns = [ITEM[name] for name in RESULT_COLUMNS if name != "sample_index"] + [ITEM.samples]
        states = FINISHED_ITEM_STATES + (("queued", "waiting") if cancelled else ())
        last_seq: int | None = None
        while True:
            # One row per document: a long document's parts (parent_id set) are not results of their own.
            query = select(*columns).where(ITEM.job_id == job_id, ITEM.status.in_(states), ITEM.parent_id.is_(None))
            if last_seq is not None:
                query = query.where(ITEM.seq > last_seq)
            with self._db.read() as conn:
                page = conn.execute(query.order_by(ITEM.seq).limit(PAGE)).mappings().all()
            for row in page:
                fields = dict(row)
                samples = fields.pop("samples")
                if row["status"] in ("queued", "waiting"):
                    yield {**_as_cancelled(fields), "sample_index": 0}
                else:
                    yield from expand_samples(fields, samples)
            if len(page) < PAGE:
                return
            last_seq = page[-1]["seq"]


def _as_queued(row: Any) -> NewItem:
    """The NewItem of an items row (custom_id, input, prompt, params_json, seq); a refused item has no prompt."""
    return NewItem(row.custom_id, row.input, row.prompt or "", json.loads(row.params_json), row.seq)


def _as_cancelled(row: dict[str, Any]) -> dict[str, Any]:
    """A queued item's result row once its job was cancelled, as the cancel would have written it."""
    return {**row, "status": "cancelled", "finish_reason": "cancelled"}
