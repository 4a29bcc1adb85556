"""The broker's side of `--trace FILE`: its own spans, the stages' step records, one Trace Event file.

The broker records its pipeline loop's work directly (planning and transmitting each step, reading
and applying each result, the stages loading their spans). The stages' step records arrive over the
control channel (on heartbeats, and as TRACE answers to TRACE_FLUSH, see stages/tracing.py); the
control plane hands them here (`stage_message`). At the end of every run the pipeline asks the chain
for the records not shipped yet (`collect`), so the trace and the run's stage_stats describe the same
steps; the file is written after each run and again when the broker closes (Ctrl-C, a failure),
with whatever has arrived by then.

Clocks: every span is on wall-clock microseconds (monotonic readings mapped once per process onto the
wall clock). A stage on the broker's host shares its clock: its spans are used as they are. A stage
on another host gets the offset estimated from the heartbeats each way (wire.trace_events.
clock_offset_us: within half the difference of the two least one-way delays); the estimate is
in otherData either way.

Bounded: at most `capacity` records per stage and `capacity` broker spans are kept, the newest; how
many were dropped (here or in a stage's own buffer) is in otherData.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from layerbus.wire import protocol
from layerbus.wire.trace_events import (
    BROKER_PID,
    BROKER_TID,
    FIRST_STAGE_PID,
    STAGE_TID,
    StepRecord,
    clock_offset_us,
    complete,
    process_metadata,
    step_events,
    thread_metadata,
    trace_document,
)

if TYPE_CHECKING:
    from layerbus.planner.chain import Placement
    from layerbus.broker.control import ControlPlane, StageInfo

log = logging.getLogger("layerbus.broker")

DEFAULT_CAPACITY = 200_000


@dataclass
class StageTrace:
    """What has arrived from one stage."""

    name: str
    host: str
    records: deque
    layers: list[str] = field(default_factory=list)  # the spans it was given, in order ("[0, 15)")
    chunks: set[int] = field(default_factory=set)  # chunk numbers received
    finals: dict[int, int] = field(default_factory=dict)  # flush id -> chunks the stage had shipped by then
    up_min_us: int | None = None  # least (broker receive time - stage send time)
    down_min_us: int | None = None  # least (stage receive time - broker send time), as the stage reports it
    stage_dropped: int = 0  # records the stage's own buffer dropped
    dropped: int = 0  # records dropped here (beyond capacity)
    malformed: int = 0
    stats: dict = field(default_factory=dict)  # its stats with its last flush answer

    def flushed(self, flush_id: int) -> bool:
        return flush_id in self.finals and len(self.chunks) >= self.finals[flush_id]


class BrokerTrace:
    def __init__(self, path: str | os.PathLike, capacity: int = DEFAULT_CAPACITY,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 host: str | None = None):
        self.path = Path(path)
        self.capacity = capacity
        self.clock = clock
        self.anchor = wall() - clock()
        self.host = host or socket.gethostname()
        self.spans: deque[tuple] = deque(maxlen=capacity)  # (name, cat, start_us, end_us, args)
        self.spans_dropped = 0
        self.stages: dict[str, StageTrace] = {}  # in the order they were first placed
        self.flush_id = 0

    # -- clocks ----------------------------------------------------------------------------------
    def now(self) -> float:
        """The clock spans are given in (monotonic seconds)."""
        return self.clock()

    def to_us(self, monotonic: float) -> int:
        return round((monotonic + self.anchor) * 1e6)

    def now_us(self) -> int:
        return self.to_us(self.clock())

    # -- the broker's own spans ------------------------------------------------------------------
    def span(self, name: str, cat: str, began: float, ended: float, **args) -> None:
        if len(self.spans) == self.capacity:
            self.spans_dropped += 1
        self.spans.append((name, cat, self.to_us(began), self.to_us(ended), args))

    def placed(self, placement: Placement, hosts: dict[str, str]) -> None:
        """A placement's stages are loading their spans: name each stage's lane after its layers."""
        for name, span in zip(placement.stages, placement.spans):
            trace = self._stage(name, hosts.get(name, "?"))
            if not trace.layers or trace.layers[-1] != str(span):
                trace.layers.append(str(span))

    # -- the stages' records ---------------------------------------------------------------------
    def _stage(self, name: str, host: str) -> StageTrace:
        if name not in self.stages:
            self.stages[name] = StageTrace(name, host, deque(maxlen=self.capacity))
        return self.stages[name]

    def stage_message(self, stage: StageInfo, payload: dict) -> None:
        """A heartbeat's or TRACE message's `trace` field, from the control plane. It came over a socket:
        malformed parts are counted and left out, never raised."""
        now_us = self.now_us()
        trace = self._stage(stage.name, stage.host)
        trace.host = stage.host  # as it registered (a stage may come back from another machine)
        sent_us, down_min_us = payload.get("sent_us"), payload.get("down_min_us")
        if type(sent_us) is int and (trace.up_min_us is None or now_us - sent_us < trace.up_min_us):
            trace.up_min_us = now_us - sent_us
        if type(down_min_us) is int:
            trace.down_min_us = down_min_us
        if type(payload.get("dropped")) is int:
            trace.stage_dropped = payload["dropped"]
        records = payload.get("records")
        if type(payload.get("chunk")) is int and isinstance(records, list):
            trace.chunks.add(payload["chunk"])
            for value in records:
                try:
                    record = StepRecord.from_json(value)
                except ValueError:
                    trace.malformed += 1
                    continue
                if len(trace.records) == self.capacity:
                    trace.dropped += 1
                trace.records.append(record)
        if type(payload.get("final")) is int and type(payload.get("chunks")) is int:
            trace.finals[payload["final"]] = payload["chunks"]

    def collect(self, control: ControlPlane, stages: list[StageInfo], timeout_s: float = 5.0) -> list[str]:
        """Ask `stages` for every record they have not shipped and wait for all of it (at most
        `timeout_s`). Each answer also carries the stage's stats, which the control plane keeps, so
        stage_stats read afterwards count the same steps as the trace. Returns the stages that did not
        answer in time."""
        self.flush_id += 1
        waiting = []
        for stage in stages:
            if stage.state.alive:
                self._stage(stage.name, stage.host)
                control.send(stage, protocol.TRACE_FLUSH, id=self.flush_id)
                waiting.append(stage.name)
        deadline = self.clock() + timeout_s
        while waiting and self.clock() < deadline:
            control.poll(20)  # stage_message is called from here
            waiting = [name for name in waiting if not self.stages[name].flushed(self.flush_id)]
        if waiting:
            log.warning("trace: no answer from %s within %.0f s; their last steps may be missing", waiting, timeout_s)
        for trace in self.stages.values():
            if trace.name not in waiting and self.flush_id in trace.finals:
                trace.stats = dict(control.stage(trace.name).stats)
        return waiting

    # -- the file --------------------------------------------------------------------------------
    def offset_us(self, trace: StageTrace) -> int:
        """Broker clock minus this stage's: 0 on the broker's own host (one clock), else estimated."""
        return 0 if trace.host == self.host else clock_offset_us(trace.up_min_us, trace.down_min_us)

    def document(self) -> dict:
        events = [*process_metadata(BROKER_PID, f"broker ({self.host})", 0),
                  thread_metadata(BROKER_PID, BROKER_TID, "pipeline loop")]
        events += [complete(name, cat, start, end - start, BROKER_PID, BROKER_TID, args)
                   for name, cat, start, end, args in self.spans]
        stages = {}
        for index, trace in enumerate(self.stages.values()):
            pid = FIRST_STAGE_PID + index
            layers = " then ".join(trace.layers) if trace.layers else "(no layers)"
            events += process_metadata(pid, f"{trace.name} layers {layers}", index + 1)
            events.append(thread_metadata(pid, STAGE_TID, "main loop"))
            events += step_events(list(trace.records), pid, self.offset_us(trace))
            estimate = clock_offset_us(trace.up_min_us, trace.down_min_us)
            stages[trace.name] = {"pid": pid, "host": trace.host, "layers": trace.layers, "steps": len(trace.records),
                                  "clock_offset_us": self.offset_us(trace), "clock_offset_estimate_us": estimate,
                                  "dropped": trace.dropped + trace.stage_dropped, "malformed": trace.malformed,
                                  "stats": trace.stats}
        return trace_document(events, {"producer": "layerbus", "broker_host": self.host, "stages": stages,
                                       "broker_spans_dropped": self.spans_dropped})

    def write(self) -> Path:
        """Write the trace so far (atomically: a reader never sees half a file); returns its path."""
        document = self.document()
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(temporary, "w") as handle:
            json.dump(document, handle, separators=(",", ":"))
        os.replace(temporary, self.path)
        log.info("trace: %d events written to %s", len(document["traceEvents"]), self.path)
        return self.path
