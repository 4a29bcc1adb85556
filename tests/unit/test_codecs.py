"""Wire codecs (wire/codecs.py): bytes per hop, round-trip error bounds on random and outlier-heavy
hidden states, and every kind of malformed compressed message refused with a WireError."""

from __future__ import annotations

import math

import pytest
import torch

from layerbus.wire import codecs
from layerbus.wire.codecs import CODEC_NAMES, SCHEMES, decode, encode, pack, unpack, wire_bytes
from layerbus.wire.frames import WireError
from layerbus.wire.frames import decode as decode_frames
from layerbus.wire.frames import encode as encode_frames

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
OUTLIER_CHANNELS = [5, 100, 300, 511]


def gaussian(rows: int = 48, hidden: int = 576, seed: int = 0, scale: float = 1.8) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)) * scale


def outlier_heavy(rows: int = 48, hidden: int = 576, seed: int = 1) -> torch.Tensor:
    """As SmolLM2's residual stream: a few channels ~100-200x the median, one token with a 380."""
    x = gaussian(rows, hidden, seed)
    x[:, [c % hidden for c in OUTLIER_CHANNELS]] *= 120
    x[0, 7] = 380.0
    return x


def round_trip(codec: str, x: torch.Tensor) -> torch.Tensor:
    meta, parts = encode(codec, x)
    assert meta["name"] == codec
    return decode(meta, parts).float()


# -- size -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec, at_most", [("float32", 1.0), ("float16", 0.5), ("bfloat16", 0.5),
                                            ("int8", 0.27), ("int4", 0.15)])
def test_bytes_per_hop_against_float32(codec: str, at_most: float) -> None:
    """Scales and kept outliers counted: every byte the frames carry."""
    x = gaussian(32, 576)
    _, parts = encode(codec, x)
    sent = sum(t.numel() * t.element_size() for t in parts.values())
    assert sent == wire_bytes(codec, 32, 576)
    assert sent / (x.numel() * 4) <= at_most
    if codec in ("float16", "bfloat16"):
        assert sent / (x.numel() * 4) == 0.5


def test_float32_never_widens_a_16_bit_tensor() -> None:
    x = gaussian(4, 64).to(torch.bfloat16)
    _, parts = encode("float32", x)
    assert parts[""].dtype == torch.bfloat16
    assert torch.equal(decode(*encode("float32", x)), x)


# -- error bounds ---------------------------------------------------------------------------------

def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("hidden", [576, 64, 50, 7])
def test_float_codecs_round_to_nearest(hidden: int) -> None:
    x = gaussian(16, hidden)
    assert torch.equal(round_trip("float32", x), x)
    for codec, mantissa_bits in (("float16", 10), ("bfloat16", 7)):
        error = (round_trip(codec, x) - x).abs()
        assert bool((error <= x.abs() * 2.0 ** -(mantissa_bits + 1) + 1e-7).all()), codec


def quantization_bound(codec: str, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per row, the largest error norm rounding can cause: half a step per padded channel (the
    rotation is orthonormal, so it keeps norms), plus float16 rounding of the kept outliers."""
    scheme = SCHEMES[codec]
    scales = parts["scale"].float()
    per_channel_sq = (scales / 2) ** 2 * scheme.group  # sum over each group of (step / 2)^2
    bound = per_channel_sq.sum(dim=1).sqrt()
    if "outlier_value" in parts:
        bound = bound + parts["outlier_value"].float().abs().norm(dim=1) * 2.0 ** -11
    return bound


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("make", [gaussian, outlier_heavy], ids=["gaussian", "outlier-heavy"])
@pytest.mark.parametrize("hidden", [576, 64, 50])
def test_integer_codecs_stay_within_their_rounding_bound(codec: str, make, hidden: int) -> None:
    x = make(24, hidden)
    meta, parts = encode(codec, x)
    error = (decode(meta, parts) - x).norm(dim=1)
    assert bool((error <= quantization_bound(codec, x, parts) * 1.001 + 1e-6).all())


# Relative error measured over the ordinary channels only: what outliers must not swamp.
ERROR_LIMITS = {"int8": 0.01, "int4": 0.12}


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("make", [gaussian, outlier_heavy], ids=["gaussian", "outlier-heavy"])
def test_outliers_do_not_swamp_the_ordinary_channels(codec: str, make) -> None:
    """Plain grouped quantization fails this on the outlier-heavy tensor (an outlier sets its
    group's step); outliers kept apart plus the rotation keep the small channels accurate."""
    x = make()
    y = round_trip(codec, x)
    ordinary = torch.ones(x.shape[1], dtype=torch.bool)
    ordinary[OUTLIER_CHANNELS + [7]] = False
    assert relative_error(y[:, ordinary], x[:, ordinary]) < ERROR_LIMITS[codec]
    # The outliers themselves (at most 5 per row here) come back at float16 precision.
    big = x.abs() > 20
    assert int(big.sum(dim=1).max()) <= 5
    torch.testing.assert_close(y[big], x[big], rtol=2 ** -10, atol=0)


def test_plain_grouped_int8_would_fail_the_outlier_test() -> None:
    """The outlier test can fail: without outliers kept or a rotation, int8 misses its limit."""
    plain = codecs.QuantScheme(levels=127, group=64, block=0, outliers=0)
    original = SCHEMES["int8"]
    SCHEMES["int8"] = plain
    try:
        x = outlier_heavy()
        y = round_trip("int8", x)
    finally:
        SCHEMES["int8"] = original
    ordinary = torch.ones(x.shape[1], dtype=torch.bool)
    ordinary[OUTLIER_CHANNELS + [7]] = False
    assert relative_error(y[:, ordinary], x[:, ordinary]) > ERROR_LIMITS["int8"]


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_zero_rows_and_all_zero_rows(codec: str) -> None:
    assert round_trip(codec, torch.zeros(0, 64)).shape == (0, 64)
    assert torch.equal(round_trip(codec, torch.zeros(3, 64)), torch.zeros(3, 64))


@pytest.mark.parametrize("codec", ["float16", "int8", "int4"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e6])
def test_values_a_codec_cannot_carry_travel_as_float32(codec: str, bad: float) -> None:
    x = gaussian(4, 64)
    x[2, 3] = bad
    meta, parts = encode(codec, x)
    assert meta["name"] == "float32"
    assert torch.equal(decode(meta, parts), x, ) or math.isnan(bad)
    assert parts[""].dtype == torch.float32


# -- messages -------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_through_real_frames(codec: str) -> None:
    x = outlier_heavy(8, 576)
    fields, tensors = pack("hidden", x, codec)
    message = decode_frames(encode_frames(dict(fields, kind="step"), tensors))
    assert message.header["codec"]["name"] == codec
    torch.testing.assert_close(unpack("hidden", message.header, message.tensors).float(), round_trip(codec, x))


def test_a_message_without_codec_is_the_old_uncompressed_form() -> None:
    x = gaussian(2, 64)
    assert torch.equal(unpack("hidden", {}, {"hidden": x}), x)
    with pytest.raises(WireError, match=r"exactly one tensor 'hidden'"):
        unpack("hidden", {}, {"hidden": x, "other": x})


# -- malformed input ------------------------------------------------------------------------------

def mutated(codec: str, change) -> tuple[dict, dict]:
    meta, parts = encode(codec, outlier_heavy(6, 576))
    parts = {name: tensor.clone() for name, tensor in parts.items()}
    change(meta, parts)
    return meta, parts


def set_part(name, value):
    def change(meta, parts):
        parts[name] = value(parts[name]) if callable(value) else value
    return change


def set_item(name, index, value):
    def change(meta, parts):
        parts[name][index] = value
    return change


MALFORMED = {
    "unknown codec": ("int8", lambda m, p: m.update(name="int3"), r"must be an object naming one of"),
    "meta not an object": ("int8", lambda m, p: m.clear(), r"must be an object naming one of"),
    "shape not [rows, hidden]": ("int8", lambda m, p: m.update(shape=[6]), r"codec shape must be \[rows, hidden\]"),
    "negative rows": ("int8", lambda m, p: m.update(shape=[-1, 576]), r"codec shape must be"),
    "shape of bools": ("int8", lambda m, p: m.update(shape=[True, 576]), r"codec shape must be"),
    "shape says more rows than sent": ("int8", lambda m, p: m.update(shape=[7, 576]),
                                       r"part 'q' must be int8 \[7, 576\], got int8 \[6, 576\]"),
    "truncated: scales missing": ("int8", lambda m, p: p.pop("scale"), r"needs parts"),
    "truncated: outliers missing": ("int4", lambda m, p: p.pop("outlier_value"), r"needs parts"),
    "extra part": ("int8", set_part("extra", torch.zeros(1)), r"needs parts"),
    "short payload": ("int4", set_part("q", lambda q: q[:, :-1]), r"part 'q' must be uint8 \[6, 288\]"),
    "wrong payload dtype": ("int8", set_part("q", lambda q: q.to(torch.int16)), r"part 'q' must be int8"),
    "wrong scale count": ("int8", set_part("scale", lambda s: s[:, :-2]), r"part 'scale' must be float16 \[6, 9\]"),
    "scales in float32": ("int4", set_part("scale", lambda s: s.float()), r"part 'scale' must be float16"),
    "NaN scale": ("int8", set_item("scale", (1, 2), math.nan), r"scales must be finite and >= 0"),
    "infinite scale": ("int4", set_item("scale", (0, 0), math.inf), r"scales must be finite and >= 0"),
    "negative scale": ("int4", set_item("scale", (3, 1), -1.0), r"scales must be finite and >= 0"),
    "int8 value -128": ("int8", set_item("q", (0, 0), -128), r"value -128 is never sent"),
    "int4 nibble 0": ("int4", set_item("q", (0, 0), 0), r"nibble 0 \(-8\) is never sent"),
    "outlier index past hidden": ("int4", set_item("outlier_index", (0, -1), 576), r"must lie in \[0, 576\)"),
    "negative outlier index": ("int8", set_item("outlier_index", (2, 0), -3), r"must lie in \[0, 576\)"),
    "repeated outlier index": ("int8", lambda m, p: p["outlier_index"].__setitem__((1, 1), int(p["outlier_index"][1, 0])),
                               r"strictly increasing"),
    "NaN outlier value": ("int4", set_item("outlier_value", (4, 2), math.nan), r"outlier values must be finite"),
    "float16 part of bfloat16": ("bfloat16", set_part("", lambda t: t.to(torch.float16)), r"must be bfloat16"),
    "float32 shape mismatch": ("float32", set_part("", lambda t: t[:, :-1]), r"must be float32/float16/bfloat16"),
    "float32 part of int type": ("float32", set_part("", lambda t: t.to(torch.int32)), r"must be float32"),
}


@pytest.mark.parametrize("codec, change, error", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_compressed_parts_are_refused(codec: str, change, error: str) -> None:
    meta, parts = mutated(codec, change)
    with pytest.raises(WireError, match=error):
        decode(meta, parts)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_truncated_frame_bytes_are_refused_before_the_codec(codec: str) -> None:
    """A frame cut short on the way never reaches decode: the frame layer checks byte counts."""
    fields, tensors = pack("hidden", gaussian(4, 576), codec)
    frames = [bytes(f) for f in encode_frames(dict(fields, kind="step"), tensors)]
    frames[1] = frames[1][:-1]
    with pytest.raises(WireError, match=r"needs \d+ bytes, frame has \d+"):
        decode_frames(frames)


def test_unexpected_tensor_beside_the_codec_parts_is_refused() -> None:
    fields, tensors = pack("hidden", gaussian(2, 64), "int8")
    with pytest.raises(WireError, match=r"unexpected tensor 'tokens' beside 'hidden'"):
        unpack("hidden", fields, dict(tensors, tokens=torch.zeros(2, dtype=torch.int64)))


def test_unknown_codec_name_on_the_sending_side() -> None:
    with pytest.raises(ValueError, match=r"wire codec 'int2' is not one of"):
        encode("int2", gaussian(2, 64))
