"""The wire format (JSON header + raw tensor frames) and the step-row encoding: what travels
arrives bit for bit, and everything malformed is refused with a WireError that says why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import zmq

from layerbus.wire.frames import MAX_HEADER_BYTES, WIRE_DTYPES, WIRE_VERSION, WireError, decode, encode
from layerbus.wire.protocol import StepRow, rows_from_json, rows_to_json
from layerbus.wire.spans import LayerRange

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # read-only frames, as frames.py says
REPO = Path(__file__).resolve().parents[2]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included for floats); bools are 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool().reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert raw_bytes(got) == raw_bytes(want)


def header_frame(**fields) -> bytes:
    return json.dumps(fields).encode()


# -- round trips ----------------------------------------------------------------------------------

SHAPES = {
    "scalar": (),
    "empty": (0,),
    "empty-2d": (3, 0, 2),
    "vector": (7,),
    "matrix": (3, 5),
    "8-dims": (1, 2, 1, 2, 1, 2, 1, 2),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype_name", WIRE_DTYPES)
def test_round_trip_is_bitwise(dtype_name: str, shape: tuple[int, ...]) -> None:
    tensor = random_tensor(WIRE_DTYPES[dtype_name], shape, seed=len(shape))
    message = decode(encode({"kind": "probe", "mb": 3}, {"x": tensor}))
    assert message.kind == "probe"
    assert message.header == {"kind": "probe", "mb": 3, "v": WIRE_VERSION}
    assert list(message.tensors) == ["x"]
    assert_bitwise_equal(message.tensors["x"], tensor)


@pytest.mark.parametrize("dtype_name", WIRE_DTYPES)
def test_non_contiguous_tensor_travels_in_logical_order(dtype_name: str) -> None:
    base = random_tensor(WIRE_DTYPES[dtype_name], (6, 8), seed=7)
    for view in (base.t(), base[::2, 1::3], base.unsqueeze(0).expand(2, 6, 8)):
        assert not view.is_contiguous()
        assert_bitwise_equal(decode(encode({"kind": "k"}, {"x": view})).tensors["x"], view)


def test_several_tensors_keep_their_names_order_and_contents() -> None:
    tensors = {
        "hidden": random_tensor(torch.bfloat16, (4, 16), seed=1),
        "mask": random_tensor(torch.bool, (4,), seed=2),
        "tokens": torch.tensor([5, -1, 2**40], dtype=torch.int64),
        "nothing": torch.empty((0, 3), dtype=torch.float16),
        "scale": torch.tensor(2.5, dtype=torch.float64),
    }
    message = decode(encode({"kind": "step"}, tensors))
    assert list(message.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert_bitwise_equal(message.tensors[name], tensor)


def test_message_without_tensors_is_one_frame() -> None:
    frames = encode({"kind": "heartbeat", "stats": {"steps": 2}})
    assert len(frames) == 1
    assert json.loads(frames[0]) == {"kind": "heartbeat", "stats": {"steps": 2}, "v": 1, "tensors": []}
    assert decode(frames).header == {"kind": "heartbeat", "stats": {"steps": 2}, "v": 1}


def test_encode_refuses_a_dtype_that_cannot_travel() -> None:
    with pytest.raises(WireError, match=r"'z' has dtype torch.complex64, which cannot travel"):
        encode({"kind": "k"}, {"z": torch.zeros(2, dtype=torch.complex64)})


@pytest.fixture
def push_pull():
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    push = context.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.setsockopt(zmq.SNDTIMEO, 5000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    context.destroy(linger=0)


def test_round_trip_over_real_zeromq_sockets_without_copies(push_pull) -> None:
    push, pull = push_pull
    tensors = {name: random_tensor(dtype, (3, 4), seed=i) for i, (name, dtype) in enumerate(WIRE_DTYPES.items())}
    tensors["transposed"] = random_tensor(torch.bfloat16, (5, 3), seed=99).t()
    tensors["scalar"] = torch.tensor(7, dtype=torch.int16)
    tensors["empty"] = torch.empty(0, dtype=torch.float32)
    for round_number in range(3):
        push.send_multipart(encode({"kind": "step", "step": round_number}, tensors), copy=False)
        frames = pull.recv_multipart(copy=False)
        assert all(isinstance(frame, zmq.Frame) for frame in frames)
        message = decode(frames)
        assert message.header["step"] == round_number
        assert list(message.tensors) == list(tensors)
        for name, tensor in tensors.items():
            assert_bitwise_equal(message.tensors[name], tensor)


def test_large_tensor_over_zeromq_is_intact(push_pull) -> None:
    push, pull = push_pull
    tensor = random_tensor(torch.float32, (512, 1024), seed=3)  # 2 MiB: above zmq's small-message path
    push.send_multipart(encode({"kind": "step"}, {"hidden": tensor}), copy=False)
    assert_bitwise_equal(decode(pull.recv_multipart(copy=False)).tensors["hidden"], tensor)


# -- rejections -----------------------------------------------------------------------------------

GOOD_SPEC = {"name": "x", "dtype": "int32", "shape": [2, 3]}
GOOD_DATA = bytes(24)


def with_spec(**changes) -> list[bytes]:
    spec = dict(GOOD_SPEC, **changes)
    return [header_frame(v=1, kind="step", tensors=[spec]), GOOD_DATA]


REJECTED = {
    "no frames": ([], r"empty message: no header frame"),
    "not JSON": ([b"\xff\xfe garbage"], r"header is not valid JSON"),
    "JSON but not UTF-8 text": ([b"{\"v\": 1, \"kind\": \"\xff\"}"], r"header is not valid JSON"),
    "JSON list": ([b"[1, 2]"], r"header must be a JSON object, got list"),
    "JSON string": ([b"\"step\""], r"header must be a JSON object, got str"),
    "JSON null": ([b"null"], r"header must be a JSON object, got NoneType"),
    "no version": ([header_frame(kind="step")], r"wire version None is not 1"),
    "wrong version": ([header_frame(v=2, kind="step")], r"wire version 2 is not 1: broker and stages"),
    "version as string": ([header_frame(v="1", kind="step")], r"wire version '1' is not 1"),
    "missing kind": ([header_frame(v=1)], r"header has no string 'kind'"),
    "kind not a string": ([header_frame(v=1, kind=5)], r"header has no string 'kind'"),
    "tensors not a list": ([header_frame(v=1, kind="k", tensors={"x": 1})], r"header 'tensors' must be a list"),
    "truncated: last frame dropped": (
        encode({"kind": "step"}, {"a": torch.ones(2), "b": torch.ones(3)})[:-1],
        r"header announces 2 tensor frame\(s\) but 1 arrived \(truncated or padded message\)"),
    "padded: one frame too many": (
        [*encode({"kind": "step"}, {"a": torch.ones(2)}), b"\x00" * 8],
        r"header announces 1 tensor frame\(s\) but 2 arrived"),
    "frames without a spec": ([header_frame(v=1, kind="step"), b"1234"],
                              r"header announces 0 tensor frame\(s\) but 1 arrived"),
    "byte count short": ([with_spec()[0], GOOD_DATA[:-1]],
                         r"tensor 'x': torch.int32 \[2, 3\] needs 24 bytes, frame has 23"),
    "byte count long": ([with_spec()[0], GOOD_DATA + b"\x00"], r"needs 24 bytes, frame has 25"),
    "empty tensor with bytes": (with_spec(shape=[0, 3]), r"needs 0 bytes, frame has 24"),
    "unknown dtype": (with_spec(dtype="complex64"), r"tensor 'x': unknown dtype 'complex64'; supported: float32"),
    "dtype missing": (with_spec(dtype=None), r"unknown dtype None"),
    "spec not an object": ([header_frame(v=1, kind="k", tensors=[[1, 2]]), b""], r"tensor spec must be an object"),
    "spec without a name": (with_spec(name=7), r"tensor spec without a string name"),
    "negative dim": (with_spec(shape=[-2, -3]), r"shape must be a list of at most 8 non-negative ints, got \[-2, -3\]"),
    "float dim": (with_spec(shape=[2.0, 3]), r"shape must be a list of at most 8 non-negative ints"),
    "string dim": (with_spec(shape=["2", 3]), r"shape must be a list of at most 8 non-negative ints"),
    "bool dim": (with_spec(shape=[True, 6]), r"shape must be a list of at most 8 non-negative ints"),
    "shape not a list": (with_spec(shape=6), r"shape must be a list of at most 8 non-negative ints, got 6"),
    "nine dims": (with_spec(shape=[1] * 9), r"shape must be a list of at most 8 non-negative ints"),
}


@pytest.mark.parametrize("frames, message", REJECTED.values(), ids=REJECTED.keys())
def test_malformed_message_is_rejected_with_its_reason(frames: list[bytes], message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode(frames)


# Malformed input that once escaped decode() as some other exception, which would have killed the
# receiving process: a stage's data loop (and the broker's control loop) catch only WireError.
ESCAPING = {
    "deeply nested JSON header": (
        [b'{"v": 1, "kind": "step", "pad": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
        "json.loads raises RecursionError, which decode does not turn into a WireError"),
    "dim beyond int64 in an empty tensor": (
        [header_frame(v=1, kind="step", tensors=[{"name": "x", "dtype": "int8", "shape": [2**64, 0]}]), b""],
        "a zero-element shape passes the byte check, then torch.empty(shape) raises TypeError (overflow)"),
    "version true": (
        [header_frame(v=True, kind="step")],
        "True == 1, so a boolean 'v' passes the version check (shape and row checks exclude bools)"),
}


@pytest.mark.parametrize("frames", [pytest.param(frames, id=name) for name, (frames, _) in ESCAPING.items()])
def test_hostile_header_is_a_wire_error(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        decode(frames)


def test_eight_dims_and_zero_sized_dims_are_accepted() -> None:
    message = decode([header_frame(v=1, kind="k", tensors=[{"name": "x", "dtype": "int8", "shape": [1] * 8},
                                                           {"name": "e", "dtype": "bfloat16", "shape": [0, 5]}]),
                      b"\x07", b""])
    assert message.tensors["x"].shape == (1,) * 8 and int(message.tensors["x"].flatten()[0]) == 7
    assert message.tensors["e"].shape == (0, 5) and message.tensors["e"].dtype == torch.bfloat16


def test_message_size_limit_counts_every_frame() -> None:
    frames = encode({"kind": "step"}, {"x": torch.zeros(1000, dtype=torch.uint8)})
    total = sum(len(frame) for frame in frames)
    assert decode(frames, max_message_bytes=total).tensors["x"].numel() == 1000
    with pytest.raises(WireError, match=rf"message of {total} bytes exceeds the limit of {total - 1} bytes"):
        decode(frames, max_message_bytes=total - 1)


def test_oversized_header_is_rejected_before_parsing() -> None:
    padding = "x" * MAX_HEADER_BYTES
    frame = json.dumps({"v": 1, "kind": "step", "pad": padding}).encode()
    with pytest.raises(WireError, match=rf"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES} bytes"):
        decode([frame])
    just_fits = json.dumps({"v": 1, "kind": "step", "pad": ""}).encode()
    just_fits = just_fits.replace(b'""', b'"' + b"x" * (MAX_HEADER_BYTES - len(just_fits)) + b'"')
    assert len(just_fits) == MAX_HEADER_BYTES
    assert decode([just_fits]).kind == "step"


# -- nothing unpickles ----------------------------------------------------------------------------

FORBIDDEN = {
    "pickle import": re.compile(r"^\s*(import|from)\s+(c?pickle|_pickle|dill|cloudpickle)\b", re.MULTILINE),
    "pickle via __import__": re.compile(r"__import__\(\s*['\"](c?pickle|dill)['\"]"),
    "pyzmq pickle helpers": re.compile(r"\b(recv_pyobj|send_pyobj)\b"),
    "torch.load": re.compile(r"\btorch\.load\s*\("),
}
SKIPPED_DIRS = {".venv", "venv", ".git", "__pycache__", "tests", "site-packages", "node_modules", "build", "dist"}


def forbidden_uses(text: str) -> list[str]:
    return [name for name, pattern in FORBIDDEN.items() if pattern.search(text)]


def source_files() -> list[Path]:
    files = []
    for path in REPO.rglob("*.py"):
        parts = path.relative_to(REPO).parts[:-1]
        if not any(part in SKIPPED_DIRS or part.startswith(".") for part in parts):
            files.append(path)
    return files


@pytest.mark.parametrize("snippet, found", [
    ("import pickle\n", ["pickle import"]),
    ("x = 1\n    from pickle import loads\n", ["pickle import"]),
    ("import cloudpickle as cp\n", ["pickle import"]),
    ("mod = __import__('pickle')\n", ["pickle via __import__"]),
    ("obj = sock.recv_pyobj()\n", ["pyzmq pickle helpers"]),
    ("state = torch.load(path)\n", ["torch.load"]),
    ('"""Nothing is ever unpickled; never use pickle."""\nimport json\n', []),
], ids=["import", "indented from-import", "cloudpickle", "__import__", "recv_pyobj", "torch.load", "prose only"])
def test_forbidden_use_detector(snippet: str, found: list[str]) -> None:
    assert forbidden_uses(snippet) == found


def test_no_source_file_unpickles_anything() -> None:
    files = source_files()
    assert REPO / "wire" / "frames.py" in files and REPO / "stages" / "worker.py" in files
    offenders = {str(path.relative_to(REPO)): uses for path in files
                 if (uses := forbidden_uses(path.read_text(errors="replace")))}
    assert offenders == {}


# -- step rows ------------------------------------------------------------------------------------

ROWS = {
    "decode row": [StepRow(3, 17, 1, True, {})],
    "prefill chunk, not emitting": [StepRow(0, 0, 40, False, {})],
    "sampled row": [StepRow(5, 2, 1, True, {"t": 0.7, "k": 20, "p": 0.9, "s": 11})],
    "scored row": [StepRow(1, 4, 3, False, {}, [9, 8, 7])],
    "mixed": [StepRow(2, 9, 1, True, {}), StepRow(0, 0, 16, False, {}), StepRow(7, 3, 2, True, {}, [1, 2])],
    "no rows": [],
}


@pytest.mark.parametrize("rows", ROWS.values(), ids=ROWS.keys())
def test_rows_round_trip_through_json(rows: list[StepRow]) -> None:
    encoded = rows_to_json(rows)
    assert rows_from_json(json.loads(json.dumps(encoded))) == rows


def test_row_encoding_is_compact() -> None:
    assert rows_to_json([StepRow(3, 17, 1, True, {})]) == [[3, 17, 1, 1, {}]]
    assert rows_to_json([StepRow(1, 4, 2, False, {}, [9, 8])]) == [[1, 4, 2, 0, {}, [9, 8]]]


BAD_ROWS = {
    "rows not a list": ({"slot": 0}, r"step header 'rows' must be a list"),
    "row not a list": ([{"slot": 0}], r"step row must be \[slot, start, length, emit, sampling\(, targets\)\]"),
    "four fields": ([[0, 0, 1, 1]], r"step row must be \[slot, start, length, emit"),
    "seven fields": ([[0, 0, 1, 1, {}, [5], 0]], r"step row must be \[slot, start, length, emit"),
    "float slot": ([[0.0, 0, 1, 1, {}]], r"step row fields must be integers"),
    "string start": ([[0, "0", 1, 1, {}]], r"step row fields must be integers"),
    "bool emit": ([[0, 0, 1, True, {}]], r"step row fields must be integers"),
    "negative slot": ([[-1, 0, 1, 1, {}]], r"step row needs slot >= 0, start >= 0, length >= 1"),
    "negative start": ([[0, -4, 1, 1, {}]], r"step row needs slot >= 0, start >= 0, length >= 1"),
    "zero length": ([[0, 0, 0, 1, {}]], r"step row needs slot >= 0, start >= 0, length >= 1"),
    "sampling not an object": ([[0, 0, 1, 1, None]], r"step row sampling must be an object"),
    "targets too long": ([[0, 0, 2, 0, {}, [1, 2, 3]]], r"step row targets must be at most 2 token ids"),
    "targets not ints": ([[0, 0, 2, 0, {}, [1, "2"]]], r"step row targets must be at most 2 token ids"),
    "negative target": ([[0, 0, 2, 0, {}, [1, -1]]], r"step row targets must be at most 2 token ids"),
    "targets not a list": ([[0, 0, 1, 0, {}, 5]], r"step row targets must be at most 1 token ids"),
}


@pytest.mark.parametrize("value, message", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_malformed_rows_are_rejected(value, message: str) -> None:
    with pytest.raises(WireError, match=message):
        rows_from_json(value)


def test_null_targets_mean_no_scoring() -> None:
    assert rows_from_json([[0, 0, 2, 1, {}, None]]) == [StepRow(0, 0, 2, True, {}, None)]


# -- layer spans ----------------------------------------------------------------------------------

def test_layer_range_is_half_open() -> None:
    span = LayerRange(2, 5)
    assert list(span) == [2, 3, 4] and len(span) == 3 and str(span) == "[2, 5)"
    assert LayerRange.from_json(span.to_json()) == span
    assert len(LayerRange(4, 4)) == 0


@pytest.mark.parametrize("value, message", [
    ([3, 1], r"invalid layer range \[3, 1\): need 0 <= start <= end"),
    ([-1, 2], r"invalid layer range \[-1, 2\)"),
    ([1], r"a layer range travels as \[start, end\]"),
    ([0, 1, 2], r"a layer range travels as \[start, end\]"),
    ([0, True], r"a layer range travels as \[start, end\]"),
    ([0, 2.0], r"a layer range travels as \[start, end\]"),
    ("0-2", r"a layer range travels as \[start, end\]"),
], ids=["reversed", "negative", "one value", "three values", "bool end", "float end", "string"])
def test_layer_range_rejects_bad_values(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LayerRange.from_json(value)
