"""What a trace file must be: the Trace Event Format's JSON object form as layerbus writes it."""

from __future__ import annotations

import json
import math


def assert_valid_trace(document: object) -> None:
    """The Trace Event Format's JSON object form as layerbus writes it: complete (X) and metadata (M)
    events with their required keys and types, non-negative times, spans on one thread that never
    overlap, and a name for every process and thread that has spans."""
    assert isinstance(document, dict) and isinstance(document.get("traceEvents"), list), "{traceEvents: [...]}"
    assert document.get("displayTimeUnit") in ("ms", "ns")
    json.dumps(document, allow_nan=False)  # plain JSON: no NaN or infinity anywhere
    process_names, thread_names, spans = {}, set(), {}
    for event in document["traceEvents"]:
        assert isinstance(event, dict) and isinstance(event.get("ph"), str), event
        assert type(event.get("pid")) is int and type(event.get("tid")) is int, event
        assert isinstance(event.get("name"), str) and isinstance(event.get("args", {}), dict), event
        if event["ph"] == "X":
            assert isinstance(event.get("cat"), str), event
            for key in ("ts", "dur"):
                value = event.get(key)
                assert type(value) in (int, float) and math.isfinite(value) and value >= 0, (key, event)
            spans.setdefault((event["pid"], event["tid"]), []).append(event)
        elif event["ph"] == "M":
            assert event["name"] in METADATA_NAMES, event
            if event["name"].endswith("_name"):
                assert isinstance(event["args"].get("name"), str) and event["args"]["name"], event
            else:
                assert type(event["args"].get("sort_index")) is int, event
            if event["name"] == "process_name":
                process_names[event["pid"]] = event["args"]["name"]
            elif event["name"] == "thread_name":
                thread_names.add((event["pid"], event["tid"]))
        else:
            raise AssertionError(f"unexpected phase {event['ph']!r}: {event}")
    for (pid, tid), events in spans.items():
        assert pid in process_names, f"pid {pid} has spans but no process_name"
        assert (pid, tid) in thread_names, f"pid {pid} tid {tid} has spans but no thread_name"
        events = sorted(events, key=lambda e: (e["ts"], e["dur"]))
        for before, after in zip(events, events[1:]):
            assert before["ts"] + before["dur"] <= after["ts"], f"overlapping spans on {pid}/{tid}: {before} {after}"


METADATA_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}
