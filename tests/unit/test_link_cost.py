"""The link arithmetic of `layerbus netprobe` (wire/link_cost.py) and the torch-free codec sizes
(wire/codec_sizes.py), as tables; the sizes against what the codecs really send."""

from __future__ import annotations

import math

import pytest
import torch

from layerbus.wire import codecs
from layerbus.wire.codec_sizes import CODEC_NAMES, codec_bytes, codec_name, codec_part_bytes
from layerbus.wire.link_cost import (
    bandwidth,
    link_cost,
    mbit_per_s,
    micro_batches_in_flight,
    next_burst,
    round_trips,
)


def test_codec_names_are_the_codecs_own():
    assert CODEC_NAMES == codecs.CODEC_NAMES


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("float_bytes", [4, 2])
def test_codec_sizes_match_the_codecs_arithmetic(codec, float_bytes):
    for rows in (0, 1, 3, 32):
        for hidden in (1, 5, 63, 64, 65, 576, 1000, 4096, 32767, 32768):
            expected = codecs.wire_bytes(codec, rows, hidden, float_bytes)
            assert codec_bytes(codec, rows, hidden, float_bytes) == expected, (codec, rows, hidden, float_bytes)


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("rows,hidden", [(1, 7), (3, 576), (8, 100)])
def test_codec_sizes_match_what_encode_sends(codec, rows, hidden):
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows * hidden))
    _, parts = codecs.encode(codec, x)
    sent = {part: tensor.numel() * tensor.element_size() for part, tensor in parts.items()}
    assert codec_part_bytes(codec, rows, hidden) == sent


@pytest.mark.parametrize("text,name", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                                       ("int8", "int8"), ("int4", "int4"), ("float32", "float32")])
def test_codec_aliases(text, name):
    assert codec_name(text) == name


def test_unknown_codec_lists_the_choices():
    with pytest.raises(ValueError, match="'int3' is not one of float32, .* \\(or fp32, fp16, bf16\\)"):
        codec_name("int3")


# samples -> (min, median, p99): p99 is a nearest-rank percentile, always an observed value.
ROUND_TRIPS = [
    ([0.003, 0.001, 0.002], (0.001, 0.002, 0.003)),
    ([0.5], (0.5, 0.5, 0.5)),
    ([1.0, 2.0, 3.0, 4.0], (1.0, 2.5, 4.0)),
    ([i / 1000 for i in range(1, 101)], (0.001, 0.0505, 0.099)),
    ([i / 1000 for i in range(200, 0, -1)], (0.001, 0.1005, 0.198)),
]


@pytest.mark.parametrize("samples,expected", ROUND_TRIPS)
def test_round_trip_statistics(samples, expected):
    stats = round_trips(samples)
    assert (stats.min_s, stats.median_s, stats.p99_s) == pytest.approx(expected)
    assert stats.count == len(samples) and stats.one_way_s == pytest.approx(expected[1] / 2)


@pytest.mark.parametrize("samples", [[], [0.001, -0.001]])
def test_round_trips_refuse_nothing_or_negative(samples):
    with pytest.raises(ValueError):
        round_trips(samples)


# (bytes, elapsed s, round trip s) -> bytes/s: the round trip is taken off, at most 99% of the time.
BANDWIDTH = [
    (1_000_000, 1.0, 0.0, 1_000_000),
    (1_000_000, 1.001, 0.001, 1_000_000),
    (2_000_000, 0.5, 0.1, 5_000_000),
    (1000, 0.001, 0.002, 1000 / 0.00001),  # a burst no longer than the round trip: 1% counts
    (1000, 0.001, -1.0, 1_000_000),  # a nonsense round trip is ignored, never added
]


@pytest.mark.parametrize("sent,elapsed,rtt,expected", BANDWIDTH)
def test_bandwidth(sent, elapsed, rtt, expected):
    assert bandwidth(sent, elapsed, rtt) == pytest.approx(expected)


@pytest.mark.parametrize("sent,elapsed", [(0, 1.0), (10, 0.0)])
def test_bandwidth_refuses_empty_bursts(sent, elapsed):
    with pytest.raises(ValueError):
        bandwidth(sent, elapsed, 0.0)


# (messages, elapsed s, target s) -> next burst: aims at 1.2 x target, grows at most 8x, always grows.
NEXT_BURST = [
    (1, 0.001, 0.5, 8),
    (8, 0.1, 0.5, 48),
    (100, 0.45, 0.5, 134),
    (100, 0.6, 0.5, 101),
    (4, 0.0, 0.5, 32),
]


@pytest.mark.parametrize("messages,elapsed,target,expected", NEXT_BURST)
def test_next_burst(messages, elapsed, target, expected):
    assert next_burst(messages, elapsed, target) == expected


# (step bytes, rows, bytes/s, one way s) -> (transfer s, link s, per token s, tokens/s cap)
LINK_COSTS = [
    (73_728, 32, 125e6, 0.0001, (73_728 / 125e6, 0.0001 + 73_728 / 125e6, (0.0001 + 73_728 / 125e6) / 32,
                                 32 / (73_728 / 125e6))),
    (1_000_000, 10, 1e6, 0.0, (1.0, 1.0, 0.1, 10.0)),
    (0, 1, 1e6, 0.002, (0.0, 0.002, 0.002, math.inf)),
]


@pytest.mark.parametrize("step_bytes,rows,rate,one_way,expected", LINK_COSTS)
def test_link_cost(step_bytes, rows, rate, one_way, expected):
    cost = link_cost(step_bytes, rows, rate, one_way)
    assert (cost.transfer_s, cost.link_s, cost.per_token_s, cost.tokens_per_s_cap) == pytest.approx(expected)
    assert cost.to_json()["link_step_ms"] == pytest.approx(expected[1] * 1e3)


@pytest.mark.parametrize("args", [(-1, 1, 1.0, 0.0), (1, 0, 1.0, 0.0), (1, 1, 0.0, 0.0), (1, 1, 1.0, -0.1)])
def test_link_cost_refuses_impossible_links(args):
    with pytest.raises(ValueError):
        link_cost(*args)


# (stages, link s one way, transfer s, compute s) -> micro-batches in flight (None: the link sets the pace).
# Round trip = stages x compute + (stages - 1) x (one way + transfer) + 2 x one way.
IN_FLIGHT = [
    (2, 0.0, 0.0, 0.02, 2),  # a free network: one micro-batch per stage
    (4, 0.0, 0.0, 0.02, 4),
    (2, 0.0001, 0.0001, 0.02, 3),  # 40.4 ms over 20: any cost at all needs one more, or a stage waits for it
    (2, 0.005, 0.01, 0.02, 4),  # 40 + 15 + 10 = 65 ms over 20 ms
    (3, 0.005, 0.01, 0.02, 5),  # 60 + 30 + 10 = 100 ms over 20 ms: exactly 5
    (2, 0.05, 0.02, 0.02, 11),  # 40 + 70 + 100 = 210 ms: a long round trip hides behind many micro-batches
    (2, 0.0, 0.021, 0.02, None),  # the transfer alone outlasts the compute: the link sets the pace
    (1, 0.01, 0.0, 0.02, 2),  # one stage: only the broker's two links, 20 + 20 ms
]


@pytest.mark.parametrize("stages,one_way,transfer,compute,expected", IN_FLIGHT)
def test_micro_batches_in_flight(stages, one_way, transfer, compute, expected):
    link = link_cost(round(transfer * 1e6), 1, 1e6, one_way)
    assert micro_batches_in_flight(stages, link, compute) == expected


def test_mbit_per_s():
    assert mbit_per_s(1e6) == 8.0 and mbit_per_s(125_000) == 1.0
