"""The measuring side of `layerbus netprobe` (wire/link_probe.py) over real ZeroMQ sockets on loopback,
with the peer in a thread of this process: framing, echoes, burst counts, and what happens when nobody
answers. No figure is asserted beyond being positive: timing depends on the machine."""

from __future__ import annotations

import pytest
import zmq

from layerbus.wire import frames, link_probe
from layerbus.wire.codec_sizes import codec_part_bytes
from tests.helpers.link_peers import echo_peer


@pytest.fixture
def peer():
    """A probe peer serving on a free loopback port in a thread: yields its address."""
    with echo_peer() as address:
        yield address


@pytest.fixture
def prober():
    """(out, inp, reply): a PUSH to connect and a bound PULL for the answers."""
    context = zmq.Context()
    out, inp = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    inp.bind("tcp://127.0.0.1:*")
    yield out, inp, inp.last_endpoint.decode()
    out.close(linger=0)
    inp.close(linger=0)
    context.term()


def test_probe_messages_are_data_plane_messages():
    parts = link_probe.step_parts(codec_part_bytes("int8", 4, 100))
    assert list(parts) == ["hidden.q", "hidden.scale", "hidden.outlier_index", "hidden.outlier_value"]
    payload = memoryview(bytearray(max(parts.values())))
    message = frames.decode(link_probe.step_frames(parts, 4, payload, 7, True, "tcp://127.0.0.1:9"))
    assert message.kind == link_probe.DATA and message.header["burst"] == 7 and message.header["last"] is True
    assert len(message.header["rows"]) == 4
    assert {name: tensor.numel() for name, tensor in message.tensors.items()} == parts
    assert frames.decode([link_probe.header_frame(link_probe.ECHO, seq=3, reply="x")]).header["seq"] == 3


@pytest.mark.parametrize("message,problem", [
    ([b"not json"], "Expecting value"),
    ([b'{"v":2,"kind":"netprobe_echo","tensors":[]}'], "version-1"),
    ([b'{"v":1,"kind":"netprobe_data","tensors":[]}', b"xx"], "1 tensor frame"),
    ([b'{"v":1,"kind":"netprobe_data","tensors":[{"name":"a","dtype":"uint8","shape":[3]}]}', b"xx"], "2 bytes"),
])
def test_malformed_headers_are_refused(message, problem):
    with pytest.raises(ValueError, match=problem):
        link_probe.parse_header(message)


def test_echoes_bursts_and_bandwidth_against_a_peer(peer, prober):
    out, inp, reply = prober
    out.connect(peer)
    samples = link_probe.measure_round_trips(out, inp, reply, 20)
    assert len(samples) == 20 and all(s > 0 for s in samples)

    parts = link_probe.step_parts(codec_part_bytes("float32", 8, 64))
    burst = link_probe.send_burst(out, inp, reply, parts, 8, 5, burst=0)
    assert burst.messages == 5 and burst.seconds > 0
    assert burst.step_bytes > 8 * 64 * 4 and burst.bytes_sent >= 5 * 8 * 64 * 4  # the peer counted them all

    sample = link_probe.measure_bandwidth(out, inp, reply, parts, 8, min(samples), target_s=0.05, first_burst=1)
    assert sample.bytes_per_s > 0 and sample.bursts >= 1
    assert sample.burst.seconds >= 0.05 or sample.burst.bytes_sent * 8 > 4 << 30


def test_the_peer_ignores_malformed_probes_and_answers_the_next(peer, prober):
    out, inp, reply = prober
    out.connect(peer)
    out.send_multipart([b"garbage"])
    out.send_multipart([link_probe.header_frame(link_probe.ECHO, seq=1, reply="http://elsewhere")])
    assert len(link_probe.measure_round_trips(out, inp, reply, 2)) == 2


def test_a_wrong_count_is_an_error(peer, prober):
    """A burst whose messages the peer did not all count (here: one more arrives first under the same
    burst number) is refused rather than turned into a figure."""
    out, inp, reply = prober
    out.connect(peer)
    link_probe.measure_round_trips(out, inp, reply, 1)
    parts = {"hidden": 100}
    out.send_multipart(link_probe.step_frames(parts, 1, memoryview(bytearray(100)), 4, False, reply))
    with pytest.raises(link_probe.ProbeError, match="the peer counted 3 message"):
        link_probe.send_burst(out, inp, reply, parts, 1, 2, burst=4)


def test_nobody_answering_is_an_error_not_a_hang(prober):
    out, inp, reply = prober
    out.connect("tcp://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(link_probe.ProbeError, match="no netprobe_echo answer in time"):
        link_probe.measure_round_trips(out, inp, reply, 1, timeout_s=0.2)
