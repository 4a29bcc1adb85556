"""The result row: one finished item as results files hold it and `JobStore.item_results` yields it.

Its columns are defined here once; storage.results builds the Parquet schema from them, the store
selects them, and `result_row` is the one place that turns a finished claimed item into a row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from layerbus.storage.records import ClaimedItem, ItemResult

# The columns of a result row in file order, each with its Arrow type (pyarrow.type_for_alias names);
# seq (the item's position in the input) orders the final file.
RESULT_FIELDS = (
    ("custom_id", "string"),
    ("input", "string"),
    ("output", "string"),
    ("finish_reason", "string"),
    ("prompt_tokens", "int64"),
    ("completion_tokens", "int64"),
    ("latency_s", "double"),
    ("error", "string"),
    ("status", "string"),
    ("seq", "int64"),
    # JSON of OpenAI's choice.logprobs when the item asked for logprobs, else null; last, so the older columns
    # keep their places.
    ("logprobs", "string"),
    # Which of the item's samples (OpenAI's n) the row is: 0 to n-1, one row each; 0 for an item of one sample.
    # Parquet files written before it lack the column: their rows are sample 0.
    ("sample_index", "int64"),
)
RESULT_COLUMNS = tuple(name for name, _ in RESULT_FIELDS)
# What each sample of the store's items.samples column holds (jobs/samples.py), besides its place in the list.
SAMPLE_FIELDS = ("output", "finish_reason", "completion_tokens", "latency_s", "error", "logprobs")


def result_row(item: ClaimedItem, result: ItemResult, sample_index: int = 0) -> dict[str, Any]:
    """The row of a claimed item (or of one of its samples) that finished with `result`: the values
    complete_items stores for it."""
    return {
        "custom_id": item.custom_id, "input": item.input, "output": result.output,
        "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens, "latency_s": result.latency_s,
        "error": result.error, "status": result.status, "seq": item.seq, "logprobs": result.logprobs,
        "sample_index": sample_index,
    }  # fmt: skip


def expand_samples(row: dict[str, Any], samples: str | None) -> Iterator[dict[str, Any]]:
    """The result rows of one item row of the store: itself as sample 0 when it has no samples column (one
    sample, or a store older than `n`), else one row per sample with that sample's fields."""
    if not samples:
        yield {**row, "sample_index": 0}
        return
    for index, sample in enumerate(json.loads(samples)):
        status = row["status"] if row["status"] != "failed" or sample.get("error") else "completed"
        yield {**row, **{name: sample.get(name) for name in SAMPLE_FIELDS}, "status": status, "sample_index": index}
