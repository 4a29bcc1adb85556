"""Cluster files with hosts, [[links]] and [network]: the link between every pair of stages, and one
clear message per bad description (pure: dicts in, a link matrix out)."""

from __future__ import annotations

import math

import pytest

from layerbus.planner.cluster_file import ClusterFileError, cluster_from_description, link_entry
from layerbus.planner.network import BROKER, Link
from layerbus.planner.partition import ModelCost
from layerbus.planner.placement import Shapes

COST = ModelCost(layer=(1e6,) * 4, embed=1e3, head=1e5)
SHAPES = Shapes(num_slots=4, micro_batch_size=2, num_micro_batches=2, max_context=8, max_step_tokens=4)


def stage(name: str, host: str | None = None, **fields) -> dict:
    entry = {"name": name, "speed": 1.0, "memory": "1GiB", **fields}
    if host is not None:
        entry["host"] = host
    return entry


def two_boxes(**extra) -> dict:
    return {"stages": [stage("a0", "boxA"), stage("a1", "boxA"), stage("b0", "boxB"), stage("c0", "boxC")], **extra}


def read(data: dict):
    return cluster_from_description(data, COST, SHAPES, "cluster.toml")


def test_links_by_host_pair_with_network_defaults_and_within_a_host() -> None:
    cluster = read(two_boxes(
        links=[{"between": ["boxA", "boxB"], "bandwidth": "125MB", "latency_ms": 0.3},
               {"between": ["boxC", "boxB"], "latency_ms": 2}],
        network={"bandwidth": "1GB", "latency_ms": 0.1, "host_bandwidth": "10GiB", "host_latency_ms": 0.01,
                 "broker_host": "boxA"}))
    matrix = cluster.network
    assert [p.host for p in cluster.profiles] == ["boxA", "boxA", "boxB", "boxC"]
    assert matrix.link("a0", "a1") == Link(10 * 2**30, 0.01e-3)  # within boxA
    assert matrix.link("a1", "b0") == matrix.link("b0", "a0") == Link(125e6, 0.3e-3)  # listed, both ways
    assert matrix.link("b0", "c0") == Link(1e9, 2e-3)  # listed latency, bandwidth from [network]
    assert matrix.link("a0", "c0") == Link(1e9, 0.1e-3)  # not listed: [network]
    assert matrix.link(BROKER, "a0") == Link(10 * 2**30, 0.01e-3) and matrix.host(BROKER) == "boxA"


def test_without_hosts_each_stage_keeps_its_own_link() -> None:
    cluster = read({"stages": [stage("a", link_bandwidth="1GB", link_latency_ms=0.5), stage("b")]})
    assert cluster.network is None
    a, b = cluster.profiles
    assert (a.link_bandwidth, a.link_latency_s, a.host) == (1e9, 0.5e-3, "")
    assert b.link_bandwidth == math.inf


def test_hosts_without_links_cost_nothing_to_cross() -> None:
    matrix = read(two_boxes()).network
    assert matrix.link("a0", "b0") == Link() and matrix.link(BROKER, "a0") is None


BAD = {
    "unknown link field": (two_boxes(links=[{"between": ["boxA", "boxB"], "speed": 1}]),
                           "cluster.toml: links 1: unknown field(s) ['speed']"),
    "unknown network field": (two_boxes(network={"bandwith": "1GB"}),
                              "cluster.toml: network: unknown field(s) ['bandwith']"),
    "unknown host": (two_boxes(links=[{"between": ["boxA", "boxZ"], "bandwidth": 10}]),
                     "links 1: between: unknown host(s) ['boxZ']"),
    "one host twice": (two_boxes(links=[{"between": ["boxA", "boxA"]}]), "two different hosts"),
    "three hosts": (two_boxes(links=[{"between": ["boxA", "boxB", "boxC"]}]), "two different hosts"),
    "pair given twice": (two_boxes(links=[{"between": ["boxA", "boxB"]}, {"between": ["boxB", "boxA"]}]),
                         "links 2: a second link between boxB and boxA"),
    "bad bandwidth": (two_boxes(links=[{"between": ["boxA", "boxB"], "bandwidth": "fast"}]),
                      "links 1: bandwidth: 'fast' is not a size"),
    "negative latency": (two_boxes(network={"host_latency_ms": -1}), "network: host_latency_ms must be >= 0"),
    "some stages without host": ({"stages": [stage("a", "boxA"), stage("b")]}, "['b'] have no 'host'"),
    "links without hosts": ({"stages": [stage("a")], "links": []}, "no stage names its host"),
    "own link beside hosts": ({"stages": [stage("a", "boxA", link_bandwidth="1GB")]},
                              "describe links by host pair in [[links]]"),
    "empty host": ({"stages": [stage("a", "")]}, "host must be a non-empty string"),
    "a stage named broker": ({"stages": [stage("broker", "boxA")]}, "rename the stage"),
    "links not a list": (two_boxes(links={"between": ["boxA", "boxB"]}), "'links' must be a list"),
}


@pytest.mark.parametrize("data, message", BAD.values(), ids=BAD.keys())
def test_bad_network_descriptions_get_one_clear_message(data: dict, message: str) -> None:
    with pytest.raises(ClusterFileError) as raised:
        read(data)
    assert message in str(raised.value) and "cluster.toml" in str(raised.value)


def test_the_link_netprobe_suggests_reads_back_as_measured() -> None:
    import tomllib

    entry = tomllib.loads(link_entry(117_312_345.0, 0.000_081, ("boxA", "boxB")))
    cluster = read({"stages": [stage("a", "boxA"), stage("b", "boxB")], **entry})
    link = cluster.network.link("a", "b")
    assert link.bandwidth == pytest.approx(117_312_345.0, rel=1e-3) and link.latency_s == pytest.approx(81e-6)
