"""The result row: one finished item as results files hold it and `JobStore.item_results` yields it.

Its columns are defined here once; storage.results builds the Parquet schema from them, the store
selects them, and `result_row` is the one place that turns a finished claimed item into a row.
"""

from __future__ import annotations

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
)
RESULT_COLUMNS = tuple(name for name, _ in RESULT_FIELDS)


def result_row(item: ClaimedItem, result: ItemResult) -> dict[str, Any]:
    """The row of a claimed item that finished with `result`: the values complete_items stores for it."""
    return {
        "custom_id": item.custom_id, "input": item.input, "output": result.output,
        "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens, "latency_s": result.latency_s,
        "error": result.error, "status": result.status, "seq": item.seq, "logprobs": result.logprobs,
    }  # fmt: skip
