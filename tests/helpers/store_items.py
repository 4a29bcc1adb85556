"""A job's settings, items and results as the store tests write them: small, fixed values to assert on."""

from __future__ import annotations

from datetime import datetime, timezone

from layerbus.storage.records import ItemResult, JobSettings, NewItem

T0 = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
# A holder elsewhere, alive as far as anyone can tell: items it claims wait until the test requeues them.
GHOST = "ghost-host:1:0ff"
SETTINGS = JobSettings(task="generate", model="tiny-model", max_new_tokens=16, name="demo", input_path="in.jsonl")


def new_items(n: int, start: int = 0) -> list[NewItem]:
    return [NewItem(f"id-{i}", f"text {i}", f"prompt {i}", {"max_tokens": 4}, i) for i in range(start, start + n)]


def ok(item_id: int, tokens: int = 5) -> ItemResult:
    return ItemResult(item_id, f"out {item_id}", "stop", prompt_tokens=3, completion_tokens=tokens, latency_s=0.5)
