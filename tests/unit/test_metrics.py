"""The broker's metrics as values (broker.metrics: busy ratio windows, the step histogram, readiness,
the families of stages, counters and jobs), the stage's step histogram (stages.worker.StageStats), the
--metrics address, and the endpoint itself (broker.metrics_server) serving /metrics and /healthz over
real HTTP from a broker stand-in, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import argparse
import math
import socket
from dataclasses import replace
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from layerbus.planner.chain import Placement
from layerbus.broker.control import StageInfo, StageState
from layerbus.broker.metrics import (
    BusySample,
    busy_ratio,
    busy_sample,
    chain_ready,
    counter_families,
    job_families,
    remember,
    stage_families,
    step_histogram,
)
from layerbus.broker.metrics_server import MetricsError, MetricsServer
from layerbus.broker.run_state import BrokerCounts
from layerbus.cli.options import metrics_address
from layerbus.stages.worker import STEP_SECONDS_BUCKETS, StageStats
from layerbus.storage.records import JobStatus
from layerbus.wire.spans import LayerRange
from tests.helpers.status_records import get, job_status, stage


TWO = Placement(("a", "b"), (LayerRange(0, 3), LayerRange(3, 6)), ("int8",))


@pytest.mark.parametrize("history, now, window, expected", [
    ((), BusySample(10, 5), 60, 0.5),  # younger than the window: its whole life
    ((BusySample(10, 5),), BusySample(20, 13), 60, 13 / 20),  # still its whole life, the window's worth of it
    ((BusySample(5, 1), BusySample(30, 6)), BusySample(80, 16), 60, 15 / 75),  # since the latest a window old
    ((BusySample(10, 5), BusySample(15, 6), BusySample(90, 8)), BusySample(100, 33), 60, 27 / 85),
    ((BusySample(70, 10), BusySample(90, 12)), BusySample(100, 17), 60, 7 / 30),  # scrapes began lately: the oldest
    ((), BusySample(100, 25), 60, 0.25),  # the first scrape of an old stage: its whole life
    ((BusySample(100, 13),), BusySample(100, 13), 60, 0.13),  # no heartbeat since: the whole life
    ((), BusySample(0, 0), 60, 0.0),
    ((), BusySample(10, 10.5), 60, 1.0),  # rounding above 1 is clamped
])
def test_busy_ratio(history, now, window, expected):
    assert busy_ratio(history, now, window) == pytest.approx(expected)


@pytest.mark.parametrize("history, now, expected", [
    ((), BusySample(1, 0), (BusySample(1, 0),)),
    ((BusySample(1, 0),), BusySample(1, 0), (BusySample(1, 0),)),  # the same heartbeat twice: kept once
    ((BusySample(1, 0), BusySample(10, 1), BusySample(70, 1)), BusySample(80, 2),
     (BusySample(10, 1), BusySample(70, 1), BusySample(80, 2))),  # the latest before the window stays: the base
    ((BusySample(50, 9),), BusySample(3, 1), (BusySample(3, 1),)),  # uptime went back: a new process
])
def test_remember_keeps_the_window(history, now, expected):
    assert remember(history, now, 60) == expected


def test_a_job_that_ended_before_the_first_scrape_still_shows_busy_until_it_leaves_the_window():
    history, seen = (), []
    for uptime in (12, 13, 14, 40, 75, 200):  # the stage worked 3 s before it was first scraped, then idled
        now = BusySample(uptime, 3.0)
        seen.append(busy_ratio(history, now, 60))
        history = remember(history, now, 60)
    assert seen[:4] == [pytest.approx(3 / u) for u in (12, 13, 14, 40)] and seen[4:] == [0.0, 0.0]


def test_busy_sample_needs_a_heartbeat():
    assert busy_sample({}) is None
    assert busy_sample({"uptime_s": 4.0, "busy_s": 1.0}) == BusySample(4.0, 1.0)
    assert busy_sample({"uptime_s": "x", "busy_s": -1}) == BusySample(0.0, 0.0)


def test_stage_stats_count_steps_into_buckets_whose_sum_is_busy_time():
    stats = StageStats(started_at=0.0)
    for seconds in (0.0005, 0.001, 0.0011, 0.3, 99.0):
        stats.observe_step(seconds)
    sent = stats.to_json()
    assert sent["step_le"] == list(STEP_SECONDS_BUCKETS) and sent["steps"] == 5
    assert sent["step_counts"][0] == 2, "a step of exactly 1 ms is <= the 1 ms bound"
    assert sent["step_counts"][1] == 1 and sent["step_counts"][STEP_SECONDS_BUCKETS.index(0.5)] == 1
    assert sent["step_counts"][-1] == 1 and sum(sent["step_counts"]) == 5
    assert {"bytes_in", "bytes_out", "rss_bytes", "device_bytes"} <= set(sent)
    assert sent["rss_bytes"] > 0 and sent["device_bytes"] == 0
    buckets, total = step_histogram(sent)
    assert buckets[0] == (0.001, 2) and buckets[-1] == (math.inf, 5)
    assert total == pytest.approx(0.0005 + 0.001 + 0.0011 + 0.3 + 99.0)


@pytest.mark.parametrize("stats", [
    {},
    {"step_le": [0.1, 1.0], "step_counts": [1, 2]},  # one count short (the +Inf bucket)
    {"step_le": [1.0, 0.1], "step_counts": [1, 2, 3]},  # bounds not increasing
    {"step_le": [0.1, 1.0], "step_counts": [1, -2, 3]},
    {"step_le": [0.1, "1"], "step_counts": [1, 2, 3]},
    {"step_le": "0.1", "step_counts": [1, 2]},
])
def test_a_malformed_histogram_is_left_out(stats):
    assert step_histogram(stats) is None


@pytest.mark.parametrize("states, placement, ready", [
    ((StageState.READY, StageState.READY), TWO, True),
    ((StageState.READY, StageState.LOADING), TWO, False),  # a stage still loading (a re-plan)
    ((StageState.READY, StageState.READY), None, False),  # registered, nothing placed
    ((StageState.READY,), TWO, False),  # a stage of the chain never registered
])
def test_chain_ready(states, placement, ready):
    stages = [stage(name, state) for name, state in zip("ab", states)]
    assert chain_ready(stages, placement) is ready


def by_name(families) -> dict:
    return {family.name: family for family in families}


def values(family) -> dict:
    return {sample.labels: sample.value for sample in family.samples}


def test_stage_families_describe_each_stage_and_its_place_in_the_chain():
    stats = {"busy_s": 2.5, "tokens": 40, "bytes_out": 4096, "bytes_in": 64, "rss_bytes": 5_000_000,
             "peak_rss": 6_000_000, "device_bytes": 0, "step_le": [0.1], "step_counts": [3, 1], "uptime_s": 9.0}
    stages = [stage("a", stats=stats, memory_budget=2**30), stage("b", last_seen=99.0, device="cuda:0",
                                                                  stats={"device_bytes": 7}),
              stage("spare", StageState.SPARE, weights="")]
    families = by_name(stage_families(stages, TWO, now=100.5, ratios={"a": 0.25}))
    info = values(families["layerbus_stage_info"])
    a_info = (("stage", "a"), ("position", "0"), ("layers", "[0, 3)"), ("wire", "int8"), ("host", "box"),
              ("device", "cpu"), ("dtype", "float32"), ("weights", "fp32"))
    assert info[a_info] == 1
    assert any(dict(labels)["stage"] == "b" and dict(labels)["wire"] == "tokens" for labels in info)
    assert any(dict(labels)["stage"] == "spare" and dict(labels)["layers"] == "" for labels in info)
    state = values(families["layerbus_stage_state"])
    assert state[(("stage", "spare"), ("state", "spare"))] == 1 and state[(("stage", "spare"), ("state", "ready"))] == 0
    assert sum(state.values()) == 3, "one state per stage"
    assert values(families["layerbus_stage_heartbeat_age_seconds"]) == {
        (("stage", "a"),): 0.5, (("stage", "b"),): 1.5, (("stage", "spare"),): 0.5}
    assert values(families["layerbus_stage_busy_ratio"]) == {(("stage", "a"),): 0.25}
    assert values(families["layerbus_stage_sent_bytes_total"])[(("stage", "a"),)] == 4096
    assert values(families["layerbus_stage_received_bytes_total"])[(("stage", "a"),)] == 64
    used = values(families["layerbus_stage_memory_used_bytes"])
    assert used[(("stage", "a"), ("memory", "host"))] == 5_000_000
    assert used[(("stage", "b"), ("memory", "device"))] == 7 and (("stage", "a"), ("memory", "device")) not in used
    assert values(families["layerbus_stage_memory_budget_bytes"]) == {(("stage", "a"),): 2**30}
    histogram = families["layerbus_stage_step_seconds"]
    assert [s.labels for s in histogram.samples] == [(("stage", "a"),)]
    assert histogram.samples[0].buckets == ((0.1, 3), (math.inf, 4)) and histogram.samples[0].total == 2.5
    counters = [f for f in families.values() if f.kind == "counter"]
    assert counters and all(f.name.endswith("_total") for f in counters)


def test_counter_families():
    counts = BrokerCounts(stages_lost=2, replans_lost=1, replans_slowed=3, replans_joined=6, failed_steps=4,
                          resent_steps=5)
    families = by_name(counter_families(counts, ready=True, epoch=7))
    assert values(families["layerbus_replans_total"]) == {(("reason", "lost"),): 1, (("reason", "slowed"),): 3,
                                                          (("reason", "joined"),): 6}
    assert values(families["layerbus_stages_lost_total"]) == {(): 2}
    assert values(families["layerbus_failed_steps_total"]) == {(): 4}
    assert values(families["layerbus_step_retries_total"]) == {(): 5}
    assert values(families["layerbus_chain_ready"]) == {(): 1.0}
    assert values(families["layerbus_placement_epoch"]) == {(): 7.0}


def test_job_families():
    families = by_name(job_families([job_status(), job_status("job_2", status="queued", tokens_per_s=None,
                                                              eta_s=None, completion_tokens=0)]))
    assert values(families["layerbus_generated_tokens_total"]) == {(("job_id", "job_1"),): 45, (("job_id", "job_2"),): 0}
    assert values(families["layerbus_prompt_tokens_total"])[(("job_id", "job_1"),)] == 120
    assert values(families["layerbus_job_items"])[(("job_id", "job_1"), ("state", "queued"))] == 4
    assert values(families["layerbus_job_tokens_per_second"]) == {(("job_id", "job_1"),): 9.0}
    assert values(families["layerbus_job_eta_seconds"]) == {(("job_id", "job_1"),): 12.5}
    state = values(families["layerbus_job_state"])
    assert state[(("job_id", "job_2"), ("state", "queued"))] == 1 and state[(("job_id", "job_1"), ("state", "queued"))] == 0


@pytest.mark.parametrize("text, parsed", [
    ("9464", ("127.0.0.1", 9464)),
    ("0", ("127.0.0.1", 0)),
    ("0.0.0.0:9464", ("0.0.0.0", 9464)),
    ("metrics.local:80", ("metrics.local", 80)),
    ("[::1]:9464", ("::1", 9464)),
])
def test_metrics_address(text, parsed):
    assert metrics_address(text) == parsed


@pytest.mark.parametrize("text", ["", "host", ":9464", "127.0.0.1:", "1.2.3.4:70000", "9464x", "-1"])
def test_metrics_address_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match="HOST:PORT"):
        metrics_address(text)


# -- the endpoint, over real HTTP -------------------------------------------------------------------


class FakeStore:
    url = "sqlite:///fake.db"

    def __init__(self, status: JobStatus | None):
        self.status = status

    def job_status(self, job_id: str) -> JobStatus:
        if self.status is None:
            raise RuntimeError("database is locked")
        return replace(self.status, job_id=job_id)


def broker_stand_in(stages: list[StageInfo], placement: Placement | None):
    """What the collector reads of a Broker: its control plane's stages and clock, placement and counts."""
    control = SimpleNamespace(stages={s.identity: s for s in stages}, epoch=1, clock=lambda: 100.0)
    return SimpleNamespace(control=control, placement=placement, counts=BrokerCounts(failed_steps=2))


@pytest.fixture
def server():
    server = MetricsServer("127.0.0.1", 0)
    yield server
    server.close()


def test_the_endpoint_serves_metrics_and_readiness(server):
    assert server.address.startswith("http://127.0.0.1:") and not server.address.endswith(":0")
    assert get(f"{server.address}/healthz")[0] == 503, "no broker yet"
    code, text = get(f"{server.address}/metrics")
    assert code == 200 and "layerbus_chain_ready 0.0" in text

    stats = {"uptime_s": 10.0, "busy_s": 4.0, "step_le": [0.1], "step_counts": [5, 0], "tokens": 9}
    stages = [stage("a", stats=stats), stage("b", StageState.LOADING, stats=stats)]
    server.attach(broker_stand_in(stages, TWO))
    server.watch_job(FakeStore(job_status()), "job_7")
    assert get(f"{server.address}/healthz")[0] == 503, "stage b is still loading"
    stages[1].state = StageState.READY
    assert get(f"{server.address}/healthz") == (200, "ready: the chain is placed\n")

    families = {f.name: f for f in text_string_to_metric_families(get(f"{server.address}/metrics")[1])}
    ratios = {s.labels["stage"]: s.value for s in families["layerbus_stage_busy_ratio"].samples}
    assert ratios == {"a": 0.4, "b": 0.4}
    generated = families["layerbus_generated_tokens"]  # the parser names a counter without _total
    assert [(s.name, s.labels, s.value) for s in generated.samples] == [
        ("layerbus_generated_tokens_total", {"job_id": "job_7"}, 45.0)]
    steps = {(s.name, s.labels.get("le")): s.value for s in families["layerbus_stage_step_seconds"].samples
             if s.labels["stage"] == "a"}
    assert steps[("layerbus_stage_step_seconds_bucket", "0.1")] == 5
    assert steps[("layerbus_stage_step_seconds_bucket", "+Inf")] == steps[("layerbus_stage_step_seconds_count", None)] == 5
    assert families["layerbus_failed_steps"].samples[0].value == 2
    assert get(f"{server.address}/nothing")[0] == 404


def test_a_store_that_cannot_answer_costs_only_the_jobs_series(server):
    server.attach(broker_stand_in([stage("a")], TWO))
    server.watch_job(FakeStore(None), "job_7")
    code, text = get(f"{server.address}/metrics")
    assert code == 200 and "layerbus_stage_info" in text and 'job_id="job_7"' not in text


def test_an_address_in_use_or_unknown_names_itself_and_the_way_out():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsError, match=f"cannot serve metrics at http://127.0.0.1:{port}: .*another port"):
            MetricsServer("127.0.0.1", port)
    with pytest.raises(MetricsError, match="no-such-host.invalid"):
        MetricsServer("no-such-host.invalid", 0)


def test_watched_jobs_are_bounded(server):
    for i in range(40):
        server.watch_job(FakeStore(job_status()), f"job_{i}")
    assert list(server.collector.jobs)[0] == "job_8" and len(server.collector.jobs) == 32
