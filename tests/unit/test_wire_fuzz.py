"""A fuzzed wire: whatever bytes reach a socket, the decoder and a stage's step check either accept
a consistent message or refuse it with a WireError, never another exception (which would be a crash
or a bug a hostile peer could aim at), and never build a tensor larger than the frame it came in.

Property-based (hypothesis): arbitrary frames, and valid steps (first stage: token ids; later
stages: hidden states in every wire codec) with their header fields replaced by arbitrary JSON,
fields deleted, frames truncated, extended or swapped. The example count is bounded for CI; a
longer hunt is one command:

    LAYERBUS_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/unit/test_wire_fuzz.py
"""

from __future__ import annotations

import json
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerbus.stages.step_validation import StepExpectations, validate_step
from layerbus.wire import codecs, protocol
from layerbus.wire.frames import WireError, decode, encode
from layerbus.wire.protocol import StepRow, rows_from_json, rows_to_json

EXAMPLES = int(os.environ.get("LAYERBUS_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HIDDEN = 64
LIMIT = 1 << 16  # the message size limit the fuzzed stage runs with

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10)


def _valid_step(first: bool, codec: str, rows: list[tuple[int, int, int]]) -> list[bytes]:
    """The frames of a step a real sender would send (as bytes, as they arrive)."""
    step_rows = [StepRow(slot, start, length, True, {}) for slot, start, length in rows]
    positions = sum(length for _, _, length in rows)
    header = {"kind": protocol.STEP, "mb": 0, "step": 3, "attempt": 0, "epoch": 1, "rows": rows_to_json(step_rows),
              "release": []}
    if first:
        tensors = {"tokens": torch.arange(positions, dtype=torch.int64)}
    else:
        fields, tensors = codecs.pack("hidden", torch.randn(positions, HIDDEN), codec)
        header.update(fields)
    return [bytes(memoryview(frame)) for frame in encode(header, tensors)]


def _check(frames: list[bytes], first: bool) -> None:
    """Accepted and consistent, or refused with a WireError: nothing else may happen."""
    expect = StepExpectations(is_first=first, hidden_size=HIDDEN, epoch=1, max_message_bytes=LIMIT)
    try:
        message, _ = validate_step(frames, expect)
    except WireError:
        return
    tensor = message.tensors["tokens" if first else "hidden"]
    assert sum(row.length for row in message.header["parsed_rows"]) == tensor.shape[0]
    if first:
        assert tensor.dtype == torch.int64 and tensor.nbytes <= sum(len(f) for f in frames)
    else:
        assert tensor.shape[1] == HIDDEN


ROWS = st.lists(st.tuples(st.integers(0, 7), st.integers(0, 50), st.integers(1, 6)), min_size=1, max_size=4)
SHAPE = st.sampled_from([(True, "float32")] + [(False, codec) for codec in codecs.CODECS_BY_SIZE])


@FUZZ
@given(frames=st.lists(st.binary(max_size=300), max_size=5))
def test_arbitrary_frames_are_refused_or_decoded_consistently(frames) -> None:
    try:
        message = decode(frames, LIMIT)
    except WireError:
        return
    for tensor in message.tensors.values():
        assert tensor.nbytes <= sum(len(frame) for frame in frames)
    _check(frames, first=True)
    _check(frames, first=False)


@FUZZ
@given(shape=SHAPE, rows=ROWS, field=st.sampled_from(["kind", "v", "tensors", "mb", "step", "attempt", "epoch",
                                                      "rows", "release", "codec", "extra"]),
       value=JSON, delete=st.booleans())
def test_a_valid_step_with_one_header_field_replaced_or_deleted(shape, rows, field, value, delete) -> None:
    first, codec = shape
    frames = _valid_step(first, codec, rows)
    _check(frames, first)  # unmutated, it is accepted
    header = json.loads(frames[0])
    if delete:
        header.pop(field, None)
    else:
        header[field] = value
    _check([json.dumps(header).encode(), *frames[1:]], first)


@FUZZ
@given(shape=SHAPE, rows=ROWS, path=st.lists(st.integers(0, 6), min_size=1, max_size=3), value=JSON)
def test_a_valid_step_with_a_nested_value_replaced(shape, rows, path, value) -> None:
    """Inside the tensor specs, the codec's parameters and the rows: shapes, dtypes, sizes."""
    first, codec = shape
    frames = _valid_step(first, codec, rows)
    header = json.loads(frames[0])
    target = header[["tensors", "rows", "codec"][path[0] % 3] if not first or path[0] % 3 != 2 else "tensors"]
    for step in path[1:]:
        if isinstance(target, list) and target:
            container, key = target, step % len(target)
        elif isinstance(target, dict) and target:
            container, key = target, sorted(target)[step % len(target)]
        else:
            break
        if not isinstance(container[key], (list, dict)):
            container[key] = value
            break
        target = container[key]
    _check([json.dumps(header).encode(), *frames[1:]], first)


@FUZZ
@given(shape=SHAPE, rows=ROWS, frame=st.integers(0, 8), cut=st.integers(0, 64), extra=st.binary(max_size=64),
       action=st.sampled_from(["truncate", "extend", "drop", "duplicate", "swap", "flip"]))
def test_a_valid_step_with_its_frames_damaged(shape, rows, frame, cut, extra, action) -> None:
    first, codec = shape
    frames = _valid_step(first, codec, rows)
    index = frame % len(frames)
    if action == "truncate":
        frames[index] = frames[index][:max(0, len(frames[index]) - 1 - cut)]
    elif action == "extend":
        frames[index] = frames[index] + extra + b"\0"
    elif action == "drop":
        del frames[index]
    elif action == "duplicate":
        frames.insert(index, frames[index])
    elif action == "swap" and len(frames) > 1:
        frames[index], frames[-1] = frames[-1], frames[index]
    elif action == "flip" and frames[index]:
        position = cut % len(frames[index])
        frames[index] = frames[index][:position] + bytes([frames[index][position] ^ 0xFF]) + frames[index][position + 1:]
    _check(frames, first)


@FUZZ
@given(value=JSON)
def test_rows_from_arbitrary_json(value) -> None:
    try:
        rows = rows_from_json(value)
    except WireError:
        return
    assert all(row.slot >= 0 and row.start >= 0 and row.length >= 1 for row in rows)


def test_oversized_announcements_are_refused_before_anything_is_allocated() -> None:
    header = {"v": 1, "kind": protocol.STEP, "tensors": [{"name": "tokens", "dtype": "int64", "shape": [1 << 40]}]}
    frames = [json.dumps(header).encode(), b"\0" * 8]
    try:
        decode(frames, LIMIT)
    except WireError as error:
        assert "needs" in str(error)
    else:
        raise AssertionError("a tensor announced larger than its frame was accepted")
    try:
        decode([b"{}", b"\0" * (LIMIT + 1)], LIMIT)
    except WireError as error:
        assert "exceeds the limit" in str(error)
    else:
        raise AssertionError("a message over the limit was accepted")


# -- the broker's control channel -----------------------------------------------------------------

STAGE_KINDS = [protocol.REGISTER, protocol.READY, protocol.FAILURE, protocol.REJECTED, protocol.BYE,
               protocol.PROFILE_RESULT, protocol.PROBE_ECHO, protocol.HEARTBEAT, "unknown-kind"]
REGISTER = {"name": "stage-x", "device": "cpu", "dtype": "float32", "threads": 1, "data_address": "tcp://127.0.0.1:1"}


def _control_frames(identity: bytes, header: dict) -> list:
    import zmq

    return [zmq.Frame(identity), *(zmq.Frame(bytes(memoryview(f))) for f in encode(header))]


# What each kind carries when a stage sends it well; the fuzz replaces or removes some of it.
VALID_FIELDS = {
    protocol.REGISTER: dict(REGISTER, pid=7, host="h", memory_budget=10**9),
    protocol.READY: {"epoch": 0, "layers": [0, 2], "param_bytes": 10, "load_s": 0.5, "peak_rss": 100,
                     "rss_before_load": 50},
    protocol.FAILURE: {"epoch": 0, "mb": 0, "step": 1, "attempt": 0, "cause": "step", "error": "boom"},
    protocol.REJECTED: {"sender": "tcp://127.0.0.1:9", "error": "bad"},
    protocol.BYE: {},
    protocol.PROFILE_RESULT: {"timings": {"decode": 0.1}, "budget": 10**9},
    protocol.PROBE_ECHO: {"seq": 1},
    protocol.HEARTBEAT: {"busy_s": 1.0, "stats": {"steps": 3}, "trace": {"records": []}},
    "unknown-kind": {},
}


@FUZZ
@given(kind=st.sampled_from(STAGE_KINDS), data=st.data(), heartbeat=st.booleans())
def test_the_broker_survives_any_control_message_from_a_registered_stage(kind, data, heartbeat) -> None:
    """A registered stage (or anything speaking with its identity) sends a message of any kind with
    its fields replaced, removed or added: the broker's control plane handles it without raising,
    and keeps serving."""
    import zmq

    fields = dict(VALID_FIELDS[kind])
    for name in data.draw(st.lists(st.sampled_from(sorted(set(fields) | {"busy_s", "stats", "trace", "epoch"})),
                                   min_size=1, max_size=3, unique=True)):
        if data.draw(st.booleans()):
            fields[name] = data.draw(JSON)
        else:
            fields.pop(name, None)

    from layerbus.broker.control import ControlPlane
    from layerbus.broker.control_io import read_arrival

    context = zmq.Context.instance()
    control = ControlPlane(context, "tcp://127.0.0.1:*")
    try:
        control._handle(read_arrival(_control_frames(b"stage-x", dict(REGISTER, kind=protocol.REGISTER)), 0.0))
        assert b"stage-x" in control.stages
        identity = b"stage-x" + (protocol.HEARTBEAT_IDENTITY_SUFFIX if heartbeat else b"")
        control._handle(read_arrival(_control_frames(identity, dict(fields, kind=kind)), 1.0))
        control._handle(read_arrival(_control_frames(b"stage-x", {"kind": protocol.HEARTBEAT}), 2.0))  # still serving
    finally:
        control.close()
