"""Timelines of a run (`--trace FILE`): the step record a stage ships and the Trace Event Format file the
broker writes from them, which https://ui.perfetto.dev and chrome://tracing open.

A stage records one compact `StepRecord` per step it serves, only while the broker asks for a trace
(the ASSIGN's `trace` field), and ships them in batches over the control channel (see
stages/tracing.py). The broker turns each record into spans that tile the step exactly: receive
(wire decode and validation), compute (the layers, and on the last stage the head and sampling),
encode (the outgoing hidden states' codec) and send, plus, with `--emulate-speed`, the emulated
slowdown's sleep. Their durations add up to what StageStats.busy_s counts for the step, so a
trace's busy time per stage equals the stage's own figure. The gaps between steps become idle spans.

Event format (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
`{"displayTimeUnit": "ms", "otherData": {...}, "traceEvents": [...]}` with complete events
`{"ph": "X", "name", "cat", "ts", "dur", "pid", "tid", "args"}` (microseconds) and metadata events
`{"ph": "M", "name": "process_name" | "thread_name" | "process_sort_index", "pid", "tid", "args"}`.
Pure functions and values only: no sockets, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Span categories ("cat"): the SVG renderer (bench/trace_svg.py) colors by them.
RECEIVE, COMPUTE, SEND, IDLE = "receive", "compute", "send", "idle"
# What a stage's StageStats.busy_s counts: everything from a step's message being taken off the socket
# to its reply being handed to the next hop. Idle is the rest.
BUSY_CATEGORIES = (RECEIVE, COMPUTE, SEND)
# The broker's own spans, on its pipeline loop.
PLAN, TRANSMIT, RESULT, APPLY, PLACE = "plan", "transmit", "result", "apply", "place"

STAGE_TID = 1  # a stage's main loop: every step is served there, one at a time
BROKER_PID, BROKER_TID = 1, 1  # the broker's pipeline loop
FIRST_STAGE_PID = 2


@dataclass(frozen=True)
class StepRecord:
    """One served step, as the stage saw it: when it began (microseconds on the stage's clock), how
    long each part took, and what it carried. The parts are consecutive, so the step ends at
    `start_us + busy_us`."""

    epoch: int
    step: int
    mb: int
    attempt: int
    rows: int  # sequences in the step
    decode_rows: int  # of which one new token each (the rest prefill a chunk)
    tokens: int  # positions processed (the rows' new tokens)
    start_us: int  # the message was taken off the socket
    receive_us: int  # wire decode and validation
    compute_us: int  # the layers (and, on the last stage, the head and token choice)
    encode_us: int  # the outgoing hidden states' codec and framing (0 on the last stage)
    emulated_us: int  # --emulate-speed's sleep (0 without it)
    send_us: int  # handing the reply to the next hop's socket

    @property
    def busy_us(self) -> int:
        return self.receive_us + self.compute_us + self.encode_us + self.emulated_us + self.send_us

    @property
    def end_us(self) -> int:
        return self.start_us + self.busy_us

    def to_json(self) -> list[int]:
        """A flat list: thousands of records travel in one heartbeat, under the header size limit."""
        return [self.epoch, self.step, self.mb, self.attempt, self.rows, self.decode_rows, self.tokens,
                self.start_us, self.receive_us, self.compute_us, self.encode_us, self.emulated_us, self.send_us]

    @classmethod
    def from_json(cls, value: Any) -> StepRecord:
        """A record as received (ValueError for anything malformed: it came over a socket)."""
        if (not isinstance(value, list) or len(value) != 13
                or not all(type(v) is int for v in value) or any(v < 0 for v in value[8:])):
            raise ValueError(f"a step record is 13 integers with non-negative durations, got {value!r:.100}")
        return cls(*value)


def record_from_marks(epoch: int, step: int, mb: int, attempt: int, row_lengths: list[int],
                      started_us: int, validated_us: int, ran_us: int, encode_us: int, slept_us: int,
                      ended_us: int) -> StepRecord:
    """A record from the step's clock marks (microseconds): taken off the socket, validated, run
    (compute, then `encode_us` of encoding), slept (= ran without emulation), handed on. Durations are
    differences of the marks, so they add up to exactly ended - started."""
    encode_us = max(0, min(encode_us, ran_us - validated_us))
    return StepRecord(epoch, step, mb, attempt, len(row_lengths), sum(1 for n in row_lengths if n == 1),
                      sum(row_lengths), started_us, validated_us - started_us, ran_us - encode_us - validated_us,
                      encode_us, slept_us - ran_us, ended_us - slept_us)


def complete(name: str, cat: str, ts: int, dur: int, pid: int, tid: int, args: dict | None = None) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args or {}}


def process_metadata(pid: int, name: str, sort_index: int) -> list[dict]:
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort_index}}]


def thread_metadata(pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def step_events(records: list[StepRecord], pid: int, offset_us: int = 0, tid: int = STAGE_TID) -> list[dict]:
    """One stage's records as spans on one thread: each step's parts, and idle between steps.
    `offset_us` moves the stage's clock onto the broker's. Records that overlap an earlier one (a
    duplicate shipped twice) are left out, so spans on the thread never overlap."""
    events: list[dict] = []
    last_end: int | None = None
    last_step: int | None = None
    for record in sorted(records, key=lambda r: (r.start_us, r.step)):
        start = record.start_us + offset_us
        if last_end is not None and start < last_end:
            continue
        args = {"mb": record.mb, "step": record.step, "attempt": record.attempt, "epoch": record.epoch,
                "rows": record.rows, "decode_rows": record.decode_rows, "tokens": record.tokens}
        if last_end is not None and start > last_end:
            events.append(complete("idle", IDLE, last_end, start - last_end, pid, tid,
                                   {"after_step": last_step, "before_step": record.step}))
        at = start
        for name, cat, dur in (("receive", RECEIVE, record.receive_us), ("compute", COMPUTE, record.compute_us),
                               ("encode", SEND, record.encode_us), ("emulated slowdown", COMPUTE, record.emulated_us),
                               ("send", SEND, record.send_us)):
            if dur > 0:
                events.append(complete(name, cat, at, dur, pid, tid, args))
                at += dur
        last_end, last_step = start + record.busy_us, record.step
    return events


def trace_document(events: list[dict], other: dict | None = None) -> dict:
    """The file's JSON: events with their timestamps made relative to the earliest one (so `ts` starts
    at 0; the absolute start, in microseconds since the epoch, goes to otherData.start_us)."""
    timed = [event for event in events if event["ph"] == "X"]
    origin = min((event["ts"] for event in timed), default=0)
    shifted = [dict(event, ts=event["ts"] - origin) if event["ph"] == "X" else event for event in events]
    # displayTimeUnit and otherData first: Perfetto's streaming reader wants the display unit before the events.
    return {"displayTimeUnit": "ms", "otherData": dict(other or {}, start_us=origin), "traceEvents": shifted}


def clock_offset_us(up_min_us: int | None, down_min_us: int | None) -> int:
    """Broker clock minus stage clock, from the smallest (receive time - send time) seen each way:
    stage -> broker (heartbeats) is offset + the least one-way delay, broker -> stage is -offset +
    the least delay back. Their half-difference cancels the delays when they are about equal (NTP's
    assumption); with only the first, the offset is over-estimated by one least delay."""
    if up_min_us is None:
        return 0
    if down_min_us is None:
        return up_min_us
    return (up_min_us - down_min_us) // 2


def busy_us_by_pid(document: dict) -> dict[int, int]:
    """Per pid, the summed duration of its busy spans (receive, compute, send categories)."""
    busy: dict[int, int] = {}
    for event in document["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") in BUSY_CATEGORIES:
            busy[event["pid"]] = busy.get(event["pid"], 0) + event["dur"]
    return busy
