"""`--trace`: the step record, the Trace Event Format the broker writes, the stage's buffer and the broker's
merge, the SVG renderer and the option; no processes. `assert_valid_trace` is the format's checker, also
used on real runs by tests/cluster/test_trace_cluster.py."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from types import SimpleNamespace

import pytest

from bench.trace_svg import read_lanes, render
from layerbus.planner.chain import Placement
from layerbus.broker.trace_file import BrokerTrace
from layerbus.cli.main import build_parser
from layerbus.stages.tracing import StageTracer, untraced_flush
from layerbus.wire import protocol
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from layerbus.wire.trace_events import (
    BUSY_CATEGORIES,
    StepRecord,
    busy_us_by_pid,
    clock_offset_us,
    complete,
    process_metadata,
    record_from_marks,
    step_events,
    thread_metadata,
    trace_document,
)
from tests.helpers.trace import assert_valid_trace


def record(step: int, start_us: int, parts=(100, 2_000, 50, 0, 30), mb: int = 0) -> StepRecord:
    return StepRecord(1, step, mb, 0, 2, 1, 9, start_us, *parts)


# -- the record and the events ---------------------------------------------------------------------

def test_a_records_parts_tile_the_step_and_survive_the_wire():
    made = record_from_marks(3, 17, 2, 1, [1, 1, 7], started_us=1_000, validated_us=1_120, ran_us=3_500,
                             encode_us=200, slept_us=3_500, ended_us=3_560)
    assert (made.rows, made.decode_rows, made.tokens) == (3, 2, 9)
    assert (made.receive_us, made.compute_us, made.encode_us, made.emulated_us, made.send_us) == (120, 2_180, 200, 0, 60)
    assert made.busy_us == 2_560 and made.end_us == 3_560
    assert StepRecord.from_json(json.loads(json.dumps(made.to_json()))) == made
    # An encode reading larger than the run itself (clock granularity) is capped, never a negative compute.
    capped = record_from_marks(0, 0, 0, 0, [1], 0, 10, 20, 50, 20, 25)
    assert capped.compute_us == 0 and capped.encode_us == 10 and capped.busy_us == 25


@pytest.mark.parametrize("value", [None, [1] * 12, [1] * 14, [1] * 12 + ["x"], [1] * 12 + [True],
                                   [0] * 8 + [-1, 0, 0, 0, 0], [0] * 12 + [1.5]])
def test_malformed_records_are_refused(value):
    with pytest.raises(ValueError):
        StepRecord.from_json(value)


def test_step_events_tile_each_step_and_fill_the_gaps_with_idle():
    first, second = record(0, 1_000), record(1, 5_000, parts=(10, 500, 0, 300, 5), mb=1)
    duplicate = record(0, 1_500)  # starts inside the first: left out, so spans never overlap
    events = step_events([second, first, duplicate], pid=2, offset_us=1_000)
    names = [e["name"] for e in events]
    assert names == ["receive", "compute", "encode", "send", "idle", "receive", "compute", "emulated slowdown", "send"]
    assert events[0]["ts"] == 2_000 and events[0]["args"] == {"mb": 0, "step": 0, "attempt": 0, "epoch": 1,
                                                              "rows": 2, "decode_rows": 1, "tokens": 9}
    idle = events[4]
    assert (idle["ts"], idle["dur"], idle["cat"]) == (2_000 + first.busy_us, 5_000 - 1_000 - first.busy_us, "idle")
    busy = sum(e["dur"] for e in events if e["cat"] in BUSY_CATEGORIES)
    assert busy == first.busy_us + second.busy_us


def test_the_document_starts_at_zero_and_sums_busy_time_per_process():
    events = [*process_metadata(1, "broker", 0), thread_metadata(1, 1, "pipeline loop"),
              complete("plan", "plan", 900, 20, 1, 1, {"mb": 0}),
              *process_metadata(2, "stage-0 layers [0, 2)", 1), thread_metadata(2, 1, "main loop"),
              *step_events([record(0, 1_000), record(1, 4_000)], 2)]
    document = trace_document(events, {"producer": "test"})
    assert_valid_trace(document)
    assert document["otherData"] == {"producer": "test", "start_us": 900}
    assert min(e["ts"] for e in document["traceEvents"] if e["ph"] == "X") == 0
    assert busy_us_by_pid(document) == {2: 2 * record(0, 0).busy_us}


def test_the_checker_catches_what_it_is_for():
    good = trace_document([*process_metadata(2, "s", 1), thread_metadata(2, 1, "main loop"),
                           complete("compute", "compute", 0, 10, 2, 1), complete("send", "send", 10, 5, 2, 1)])
    assert_valid_trace(good)
    overlapping = json.loads(json.dumps(good))
    overlapping["traceEvents"][-1]["ts"] = 5
    nameless = {"traceEvents": good["traceEvents"][3:], "displayTimeUnit": "ms"}
    negative = json.loads(json.dumps(good))
    negative["traceEvents"][-1]["dur"] = -1
    for bad in (overlapping, nameless, negative, {"traceEvents": "x"}):
        with pytest.raises(AssertionError):
            assert_valid_trace(bad)


def test_clock_offset_from_the_least_delays_each_way():
    assert clock_offset_us(None, None) == 0
    assert clock_offset_us(5_300, None) == 5_300  # one way only: the offset plus the least delay
    # Stage 5 ms behind the broker, 300 us each way: up = 5000 + 300, down = -5000 + 300.
    assert clock_offset_us(5_300, -4_700) == 5_000


# -- the stage's buffer ----------------------------------------------------------------------------

class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def header(step: int, lengths=(1, 1, 4)) -> dict:
    return {"epoch": 2, "step": step, "mb": step % 3, "attempt": 0,
            "parsed_rows": [StepRow(slot, 0, length) for slot, length in enumerate(lengths)]}


def serve(tracer: StageTracer, clock: FakeClock, step: int, codec_s: float = 0.0) -> float:
    """One step as StageWorker._serve marks it: validated, run (with `codec_s` of encoding), sent."""
    started = clock.now
    clock.now += 0.0002
    marks = tracer.begin(started, 1.0)
    clock.now += 0.003
    marks.run_done(1.0 + codec_s, clock)
    clock.now += 0.0001
    tracer.record(marks, header(step), clock.now)
    busy = clock.now - started
    clock.now += 0.001  # idle until the next step
    return busy


def about_us(measured, expected) -> bool:
    """Equal to the microsecond's rounding (the marks are float seconds)."""
    return all(abs(a - b) <= 1 for a, b in zip(measured, expected, strict=True))


def test_a_stage_records_what_busy_s_counts():
    clock = FakeClock()
    tracer = StageTracer(clock=clock, wall=lambda: 1_700_000_000.0)
    busy_s = sum(serve(tracer, clock, step, codec_s=0.0005) for step in range(5))
    shipped = tracer.chunk()
    records = [StepRecord.from_json(value) for value in shipped["records"]]
    assert [r.step for r in records] == list(range(5)) and shipped["chunk"] == 1
    assert abs(sum(r.busy_us for r in records) - busy_s * 1e6) <= len(records)  # µs rounding at most
    first = records[0]
    assert about_us((first.receive_us, first.compute_us, first.encode_us, first.send_us), (200, 2_500, 500, 100))
    assert (first.rows, first.decode_rows, first.tokens, first.epoch) == (3, 2, 6, 2)
    assert first.start_us == round((1_700_000_000.0 + 0.0) * 1e6)  # wall clock at the first mark
    assert tracer.chunk() == {"sent_us": tracer.now_us(), "down_min_us": None, "dropped": 0}, "nothing left"


def test_an_emulated_slowdown_is_its_own_span():
    clock = FakeClock()
    tracer = StageTracer(clock=clock, wall=lambda: 1_700_000_000.0)
    marks = tracer.begin(clock.now - 0.001, 0.0)
    clock.now += 0.002
    marks.run_done(0.0, clock)
    clock.now += 0.004
    marks.sleep_done(clock)
    tracer.record(marks, header(0), clock.now + 0.0001)
    shipped = StepRecord.from_json(tracer.chunk()["records"][0])
    assert about_us((shipped.receive_us, shipped.compute_us, shipped.emulated_us, shipped.send_us),
                    (1_000, 2_000, 4_000, 100))


def test_a_full_buffer_drops_the_oldest_and_counts_them_and_a_flush_ships_the_rest():
    clock = FakeClock()
    tracer = StageTracer(capacity=4, clock=clock)
    for step in range(7):
        serve(tracer, clock, step)
    assert tracer.dropped == 3
    first = tracer.chunk(limit=1)
    assert first["chunk"] == 1 and [r[1] for r in first["records"]] == [3] and first["dropped"] == 3
    payloads = tracer.flush(flush_id=9, limit=2)
    assert [p["chunk"] for p in payloads] == [2, 3] and [r[1] for p in payloads for r in p["records"]] == [4, 5, 6]
    assert payloads[-1]["final"] == 9 and payloads[-1]["chunks"] == 3 and "final" not in payloads[0]
    assert tracer.flush(flush_id=10)[-1] == {**tracer.flush(flush_id=10)[-1], "final": 10, "chunks": 3}
    assert untraced_flush(4) == {"final": 4, "chunks": 0}


def test_a_stage_keeps_the_least_delay_of_the_brokers_heartbeats():
    clock = FakeClock()
    tracer = StageTracer(clock=clock, wall=lambda: 50.0)
    now_us = tracer.now_us()
    for sent_us in (now_us - 900, now_us - 300, now_us - 700, "x", None, 1.5):
        tracer.broker_heartbeat(sent_us)
    assert tracer.down_min_us == 300 and tracer.chunk()["down_min_us"] == 300


# -- the broker's merge ----------------------------------------------------------------------------

def stage(name: str, host: str = "here") -> SimpleNamespace:
    return SimpleNamespace(name=name, host=host, state=SimpleNamespace(alive=True), stats={"busy_s": 1.0})


class FakeControl:
    """Hands each TRACE_FLUSH's answers back on the next poll, as the control plane would."""

    def __init__(self, tracer: BrokerTrace, stages: dict[str, SimpleNamespace], answers):
        self.tracer, self.stages, self.answers = tracer, stages, answers
        self.sent, self.pending = [], []

    def send(self, stage, kind, **fields):
        self.sent.append((stage.name, kind, fields))
        if kind == protocol.TRACE_FLUSH:
            self.pending += [(stage, payload) for payload in self.answers(stage.name, fields["id"])]

    def poll(self, timeout_ms=0):
        if self.pending:
            stage, payload = self.pending.pop(0)
            self.tracer.stage_message(stage, payload)
        return []

    def heartbeat(self, interval_s):
        pass

    def stage(self, name):
        return self.stages[name]


def test_the_broker_merges_stages_and_its_own_spans_into_one_valid_file(tmp_path):
    clock = FakeClock(10.0)
    trace = BrokerTrace(tmp_path / "trace.json", clock=clock, wall=lambda: 1_000.0, host="here")
    near, far = stage("stage-0"), stage("stage-1", host="elsewhere")
    trace.placed(Placement(("stage-0", "stage-1"), (LayerRange(0, 2), LayerRange(2, 4))), {"stage-0": "here"})
    trace.span("plan", "plan", 10.0, 10.0001, mb=0, step=0)
    base = round(1_000.0 * 1e6)  # the broker's wall-clock µs now
    trace.stage_message(near, {"sent_us": base - 50, "down_min_us": 40, "dropped": 0, "chunk": 1,
                               "records": [record(0, base + 100).to_json(), record(1, base + 5_000).to_json()]})
    # The far stage's clock runs 2 s behind ours; 100 µs each way.
    trace.stage_message(far, {"sent_us": base - 2_000_000 - 100, "down_min_us": -2_000_000 + 100, "dropped": 2,
                              "chunk": 1, "records": [record(0, base - 2_000_000 + 3_000).to_json(), ["bad"]]})
    document = trace.document()
    assert_valid_trace(document)
    names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "broker (here)", 2: "stage-0 layers [0, 2)", 3: "stage-1 layers [2, 4)"}
    other = document["otherData"]["stages"]
    assert other["stage-0"]["clock_offset_us"] == 0, "one host, one clock: nothing is moved"
    assert other["stage-1"]["clock_offset_us"] == 2_000_000 and other["stage-1"]["malformed"] == 1
    assert other["stage-1"]["dropped"] == 2
    far_start = min(e["ts"] for e in document["traceEvents"] if e["ph"] == "X" and e["pid"] == 3)
    assert far_start + document["otherData"]["start_us"] == base + 3_000, "moved onto the broker's clock"
    assert busy_us_by_pid(document) == {2: 2 * record(0, 0).busy_us, 3: record(0, 0).busy_us}
    written = json.loads(trace.write().read_text())
    assert written == json.loads(json.dumps(document)) and not list(tmp_path.glob(".*.tmp"))


def test_collect_waits_for_every_chunk_whichever_socket_brings_it(tmp_path):
    trace = BrokerTrace(tmp_path / "t.json", host="here")
    stages = {"a": stage("a"), "b": stage("b")}
    late_chunk = {"sent_us": 0, "chunk": 2, "records": [record(7, 10).to_json()]}

    def answers(name, flush_id):
        if name == "a":  # the final answer comes before a heartbeat's chunk that was shipped earlier
            return [{"final": flush_id, "chunks": 2, "chunk": 1, "records": []}, late_chunk]
        return [{"final": flush_id, "chunks": 0}]

    control = FakeControl(trace, stages, answers)
    assert trace.collect(control, list(stages.values()), timeout_s=5.0) == []
    assert [r.step for r in trace.stages["a"].records] == [7], "waited for chunk 2"
    assert trace.stages["a"].stats == {"busy_s": 1.0}
    assert [(name, kind) for name, kind, _ in control.sent] == [("a", "trace_flush"), ("b", "trace_flush")]

    silent = FakeControl(trace, stages, lambda name, flush_id: [])
    assert trace.collect(silent, [stages["a"]], timeout_s=0.05) == ["a"]


def test_broker_spans_and_records_are_bounded(tmp_path):
    trace = BrokerTrace(tmp_path / "t.json", capacity=2)
    for i in range(3):
        trace.span("apply", "apply", i, i + 0.5)
    trace.stage_message(stage("s"), {"chunk": 1, "records": [record(i, i * 10_000).to_json() for i in range(3)]})
    assert trace.spans_dropped == 1 and trace.stages["s"].dropped == 1
    assert [r.step for r in trace.stages["s"].records] == [1, 2], "the newest are kept"


# -- the SVG and the option ------------------------------------------------------------------------

def test_the_svg_has_a_lane_per_process_and_clips_to_the_window():
    events = [*process_metadata(1, "broker", 0), thread_metadata(1, 1, "loop"),
              complete("plan", "plan", 0, 100, 1, 1),
              *process_metadata(2, "stage-0 layers [0, 2)", 1), thread_metadata(2, 1, "main loop"),
              *step_events([record(0, 1_000), record(1, 4_000)], 2)]
    document = trace_document(events)
    assert [lane.name for lane in read_lanes(document)] == ["broker", "stage-0 layers [0, 2)"]
    svg = ElementTree.fromstring(render(document, title="a & b"))
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "a & b" in texts and "stage-0 layers [0, 2)" in texts and any(t.startswith("busy ") for t in texts)
    windowed = ElementTree.fromstring(render(document, start_ms=3.5, end_ms=4.2))
    tips = [t.text for t in windowed.iter("{http://www.w3.org/2000/svg}title")]
    assert tips and all("step=1" in tip or tip.startswith("idle") for tip in tips), tips
    with pytest.raises(ValueError):
        render(trace_document([]))


def test_trace_is_an_option_of_run_and_broker(tmp_path, capsys):
    parser = build_parser()
    target = tmp_path / "t.json"
    run = parser.parse_args(["run", "in.jsonl", "--task", "summarize", "--trace", str(target)])
    broker = parser.parse_args(["broker", "--stages", "2", "--trace", str(target)])
    assert run.trace == broker.trace == str(target)
    assert parser.parse_args(["run", "in.jsonl"]).trace is None
    for bad in (tmp_path / "missing" / "t.json", tmp_path):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["run", "in.jsonl", "--trace", str(bad)])
        assert exited.value.code == 2
    assert "does not exist" in capsys.readouterr().err
