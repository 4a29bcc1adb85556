"""The measured link matrix without stage processes: link-probe messages (wire/link_probe.py) told from steps
and refused when malformed, a stage timing its link to a peer and reporting a dead one, the pairs still to
measure, the network file where it covers a pair, and the matrix reaching placement.
tests/cluster/test_link_matrix.py measures it between real stage processes."""

from __future__ import annotations

import math

import pytest
import zmq

from layerbus.broker.link_probing import MeasuredLink, missing_pairs, read_answer
from layerbus.planner.model_memory import model_memory
from layerbus.planner.network import BROKER, MEASURED, NETWORK_FILE, OWN_LINK, HostLinks, Link, live_matrix
from layerbus.planner.placement import PlanOptions, StageProfile, plan_placement
from layerbus.planner.plan_report import format_explain
from layerbus.planner.batching import BatchingConfig
from layerbus.models.model_files import open_model_dir
from layerbus.stages.peer_links import PeerProbeRequest, PeerProber, is_link_probe
from layerbus.wire import link_probe
from layerbus.wire.frames import WireError, encode
from tests.helpers.link_peers import echo_peer


@pytest.fixture
def data_port():
    """A stage's data port stand-in: a PULL answering link probes with an EchoPeer (as a stage's main
    loop does), in a thread; yields its address."""
    with echo_peer() as address:
        yield address


def _request(**overrides) -> PeerProbeRequest:
    header = dict(step_bytes=4096, rows=4, echoes=3, burst_s=0.02, connect_timeout_s=2.0)
    return PeerProbeRequest.from_header({**header, **overrides})


def test_a_stage_times_its_link_to_a_peer_and_reports_a_dead_one(data_port) -> None:
    context = zmq.Context()
    try:
        prober = PeerProber(context, "tcp://127.0.0.1:5999", "tcp://127.0.0.1:5999")
        dead = "tcp://127.0.0.1:9"  # nothing listens there: the first echo never comes back
        links = prober.probe(_request(peers=[{"name": "peer", "address": data_port}, {"name": "gone", "address": dead}],
                                      connect_timeout_s=0.5))
    finally:
        context.destroy(linger=0)
    good, bad = links
    assert good["peer"] == "peer" and good["bytes_per_s"] > 0 and math.isfinite(good["bytes_per_s"])
    assert good["round_trip_s"] > 0 and good["bursts"] >= 1
    assert bad["peer"] == "gone" and "no netprobe_echo answer" in bad["error"]


def test_probe_messages_are_told_from_steps() -> None:
    echo = [link_probe.header_frame(link_probe.ECHO, seq=1, reply="tcp://127.0.0.1:9")]
    data = link_probe.step_frames({"hidden": 8}, 2, memoryview(bytearray(8)), 0, True, "tcp://127.0.0.1:9")
    step = encode({"kind": "step", "mb": 0, "step": 0, "attempt": 0, "epoch": 1, "rows": [], "release": [],
                   "note": '"kind":"netprobe_echo"'})  # a step whose header merely holds the text
    assert is_link_probe(echo) and is_link_probe(data)
    assert not is_link_probe(step) and not is_link_probe([b"not json"]) and not is_link_probe([])


@pytest.mark.parametrize("change,problem", [
    ({"peers": [{"name": "a", "address": "nowhere"}]}, "not a ZeroMQ endpoint"),
    ({"peers": [{"address": "tcp://127.0.0.1:9"}]}, "each peer must be"),
    ({"peers": [{"name": "a", "address": "tcp://127.0.0.1:9", "key": "short"}]}, "40-character"),
    ({"burst_s": "fast"}, "burst_s"),
    ({"echoes": 0}, "echoes >= 1"),
])
def test_bad_link_probe_requests_are_refused_naming_the_field(change, problem) -> None:
    with pytest.raises(WireError, match=problem):
        _request(**{"peers": [{"name": "a", "address": "tcp://127.0.0.1:9"}], **change})


def test_an_answer_with_a_failed_pair_falls_back_for_that_pair_only(caplog) -> None:
    answer = {"links": [{"peer": "b", "round_trip_s": 0.001, "bytes_per_s": 5e8},
                        {"peer": "c", "error": "ProbeError: no netprobe_echo answer in time"}]}
    found = read_answer("a", ["b", "c", "d"], answer)
    assert found == {("a", "b"): MeasuredLink(5e8, 0.001)}
    assert "a -> c not timed" in caplog.text and "a -> d not timed" in caplog.text
    assert read_answer("a", ["b"], None) == {} and "no answer in time" in caplog.text


def test_the_live_matrix_takes_the_network_file_where_it_covers_a_pair_and_measurements_elsewhere() -> None:
    hosts = {"a0": "boxA", "a1": "boxA", "b0": "boxB"}
    measured = {(x, y): Link(1e9, 1e-4) for x in hosts for y in hosts if x != y}
    broker = {name: Link(2e9, 2e-4) for name in hosts}
    # The file describes only the boxA-boxB link: same-host pairs stay measured.
    described = HostLinks({}, {frozenset(("boxA", "boxB")): Link(1.25e6, 5e-3)}, default_given=False,
                          within_given=False)
    matrix = live_matrix(hosts, measured, broker, described, "boxA")
    assert matrix.link("a0", "b0") == Link(1.25e6, 5e-3) and matrix.source("a0", "b0") == NETWORK_FILE
    assert matrix.link("a0", "a1") == Link(1e9, 1e-4) and matrix.source("a0", "a1") == MEASURED
    assert matrix.link(BROKER, "a0") == Link(2e9, 2e-4) and matrix.link("b0", BROKER) == Link(2e9, 2e-4)
    assert set(matrix.links) == {(x, y) for x in [*hosts, BROKER] for y in [*hosts, BROKER] if x != y}
    # Without the file, and with a pair that could not be timed: the sender's own link prices it.
    partial = live_matrix(hosts, {k: v for k, v in measured.items() if k != ("a1", "b0")}, broker)
    assert partial.link("a1", "b0") is None and partial.source("a1", "b0") == OWN_LINK


def test_missing_pairs_are_those_with_a_stage_not_measured_yet() -> None:
    class Stage:
        def __init__(self, name):
            self.name = name

    a, b, c = Stage("a"), Stage("b"), Stage("c")
    measured = {("a", "b"): MeasuredLink(1.0, 0.0), ("b", "a"): MeasuredLink(1.0, 0.0)}
    wanted = missing_pairs([a, b, c], measured)
    assert {name: [p.name for p in peers] for name, peers in wanted.items()} == {"a": ["c"], "b": ["c"], "c": ["a", "b"]}


def test_the_measured_matrix_reaches_placement(tiny_models) -> None:
    """Four equal stages; the measured links make s0-s2 and s1-s3 fast and every other pair slow: the
    planner's chain crosses a slow link once (it would cross three times in the name order)."""
    model_dir = tiny_models("llama", num_hidden_layers=8, hidden_size=128, intermediate_size=512)
    names = ["s0", "s1", "s2", "s3"]
    host = {"s0": "A", "s1": "B", "s2": "A", "s3": "B"}
    measured = {(x, y): Link(1e9 if host[x] == host[y] else 2e4, 1e-4) for x in names for y in names if x != y}
    profiles = [StageProfile(name=n, memory_budget=2**33, micro_batch_size=8, prefill_tokens=256, layer_decode_s=1e-3,
                             layer_prefill_s=4e-3, head_s=1e-3, embed_s=1e-5) for n in names]
    matrix = live_matrix({n: "one-machine" for n in names}, measured, {n: Link(1e9, 1e-4) for n in names})
    plan = plan_placement(profiles, model_memory(open_model_dir(model_dir)), BatchingConfig(num_slots=8, max_context=64),
                          PlanOptions(allow_drop=False), network=matrix)
    crossings = sum(host[a] != host[b] for a, b in zip(plan.order, plan.order[1:]))
    assert crossings == 1, plan.order
    assert "(measured)" in format_explain(plan)
    kept = plan_placement(profiles, model_memory(open_model_dir(model_dir)), BatchingConfig(num_slots=8, max_context=64),
                          PlanOptions(allow_drop=False, allow_reorder=False), network=matrix)
    assert list(kept.order) == names and plan.tokens_per_s > kept.tokens_per_s


def test_a_network_file_covers_only_the_pairs_it_describes(tmp_path) -> None:
    """[[links]] covers its host pair; [network] bandwidth the other host pairs, host_bandwidth the pairs
    within a host: whatever the file leaves out stays to be measured."""
    from layerbus.planner.cluster_file import read_network_file

    hosts = {"a0": "boxA", "a1": "boxA", "b0": "boxB", "c0": "boxC"}
    links_only = tmp_path / "links.toml"
    links_only.write_text('[[links]]\nbetween = ["boxA", "boxB"]\nbandwidth = "12.5MB"\nlatency_ms = 0.5\n')
    placed = read_network_file(links_only).placing(hosts)
    assert placed.covering("a0", "b0") == Link(12.5e6, 0.0005)
    assert placed.covering("a0", "c0") is None and placed.covering("a0", "a1") is None
    full = tmp_path / "full.toml"
    full.write_text('[network]\nbandwidth = "125MB"\nhost_latency_ms = 0.02\n')
    placed = read_network_file(full).placing(hosts)
    assert placed.covering("a0", "c0") == Link(125e6, 0.0) and placed.covering("a0", "a1") == Link(latency_s=0.00002)
