"""A stage's side of `--trace`: step records kept in a bounded buffer and shipped to the broker.

The stage makes a `StageTracer` only when the broker's ASSIGN says `trace: true`; without one the
worker records nothing (one `is not None` check per mark of a step). Records travel over the control
channel the stage already has, so tracing opens no port: the heartbeat thread takes up to
`CHUNK_RECORDS` of them into each heartbeat (every 0.5 s), and at the end of a run the broker asks for
the rest with TRACE_FLUSH, answered from the main loop by TRACE messages, the last one carrying the
stage's stats at that moment and how many chunks were shipped in all (so the broker knows when it has
every one, whichever socket each came through).

Clocks: marks are `time.monotonic()` readings (the same clock StageStats.busy_s is summed from, so a
step's spans add up to exactly what busy_s counts), mapped once onto wall-clock microseconds. Stages
on other machines have their own wall clocks: each heartbeat carries its send time, and the stage keeps
the smallest (its receive time - send time) of the broker's heartbeats, from which the broker estimates
the offset (wire.trace_events.clock_offset_us).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from layerbus.wire.trace_events import record_from_marks

DEFAULT_CAPACITY = 50_000  # records waiting to be shipped; beyond this the oldest are dropped (and counted)
# Records per shipped chunk: about 80 bytes each as JSON, so a chunk stays far below the 1 MiB header limit.
CHUNK_RECORDS = 4_000


class StepMarks:
    """The clock marks of one step being served (monotonic seconds)."""

    __slots__ = ("started", "validated", "codec_before", "ran", "encode_s", "slept")

    def __init__(self, started: float, validated: float, codec_before: float):
        self.started, self.validated, self.codec_before = started, validated, codec_before
        self.ran = self.slept = validated
        self.encode_s = 0.0

    def run_done(self, codec_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        """The step has run: what the wire codec's counter grew by since validation was its encoding."""
        self.ran = self.slept = clock()
        self.encode_s = max(0.0, codec_after - self.codec_before)

    def sleep_done(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.slept = clock()


class StageTracer:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.clock = clock
        self.anchor = wall() - clock()  # monotonic -> wall clock, fixed for the tracer's life
        self.records: deque[list[int]] = deque(maxlen=capacity)
        self.dropped = 0  # records lost to a full buffer (the broker stopped draining, or a flood)
        self.chunks = 0  # chunks shipped so far (numbered from 1)
        self.down_min_us: int | None = None  # least (our receive time - broker's send time) of its heartbeats
        self._lock = threading.Lock()  # the main loop appends; the heartbeat thread and the main loop ship

    def now_us(self) -> int:
        return self.to_us(self.clock())

    def to_us(self, monotonic: float) -> int:
        return round((monotonic + self.anchor) * 1e6)

    # -- the main loop's marks -------------------------------------------------------------------
    def begin(self, started: float, codec_s: float) -> StepMarks:
        """The step's message has been validated (it was taken off the socket at `started`)."""
        return StepMarks(started, self.clock(), codec_s)

    def record(self, marks: StepMarks, header: dict, ended: float) -> None:
        rows = [row.length for row in header["parsed_rows"]]
        record = record_from_marks(header["epoch"], header["step"], header["mb"], header["attempt"], rows,
                                   self.to_us(marks.started), self.to_us(marks.validated), self.to_us(marks.ran),
                                   round(marks.encode_s * 1e6), self.to_us(marks.slept), self.to_us(ended))
        with self._lock:
            if len(self.records) == self.records.maxlen:
                self.dropped += 1
            self.records.append(record.to_json())

    def broker_heartbeat(self, sent_us: object) -> None:
        """A heartbeat from the broker stamped with its clock: keep the least apparent delay."""
        if type(sent_us) is int:
            delay = self.now_us() - sent_us
            if self.down_min_us is None or delay < self.down_min_us:
                self.down_min_us = delay

    # -- shipping --------------------------------------------------------------------------------
    def chunk(self, limit: int = CHUNK_RECORDS) -> dict:
        """Up to `limit` records for one message, with the clock fields (sent_us: now)."""
        with self._lock:
            count = min(limit, len(self.records))
            records = [self.records.popleft() for _ in range(count)]
            payload = {"sent_us": self.now_us(), "down_min_us": self.down_min_us, "dropped": self.dropped}
            if records:
                self.chunks += 1
                payload.update(chunk=self.chunks, records=records)
            return payload

    def flush(self, flush_id: object, limit: int = CHUNK_RECORDS) -> list[dict]:
        """Every record left, as chunks; the last says this flush is done and how many chunks there were."""
        payloads = [self.chunk(limit)]
        while self.records:
            payloads.append(self.chunk(limit))
        payloads[-1].update(final=flush_id, chunks=self.chunks)
        return payloads


def untraced_flush(flush_id: object) -> dict:
    """The answer to a TRACE_FLUSH from a stage that is not tracing: done, nothing shipped."""
    return {"final": flush_id, "chunks": 0}

