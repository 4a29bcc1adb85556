"""The co-run factors of stages sharing a machine are measured once and cached beside the profiles:
the same stages on the same host read them back without probing; anything the factor depends on
(threads, emulated speed, the probe's shapes) probes again.

The control plane here is a recorder that answers PROFILE messages as stages do (alone, then all at
once); the end-to-end path, with real stages, runs in every cluster test that plans local stages."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from layerbus.broker.control import ControlEvent, StageInfo
from layerbus.planner.plan_values import StageProfile
from layerbus.broker.profiling import UNKNOWN_LEAD_S, _lead_s, lockstep_excess_s, measure_sharing
from layerbus.wire import protocol

ALONE_S, TOGETHER_S = 0.010, 0.015
REQUEST = {"model_dir": "/models/tiny", "micro_batch_size": 8, "kv_length": 64, "prefill_tokens": 32}


class AnsweringControl:
    """Records every PROFILE sent; answers each with the step time a stage would measure: ALONE_S
    when it was the only one asked since the last answer, TOGETHER_S when several were."""

    def __init__(self):
        self.sent: list[str] = []
        self.pending: list[str] = []

    def send(self, stage: StageInfo, kind: str, **fields) -> None:
        assert kind == protocol.PROFILE and fields["probe_s"] > 0
        self.sent.append(stage.name)
        self.pending.append(stage.name)

    def poll(self, timeout_ms: int) -> list[ControlEvent]:
        step = ALONE_S if len(self.pending) == 1 else TOGETHER_S
        events = [ControlEvent(protocol.PROFILE_RESULT, name, {"probe_step_s": step}) for name in self.pending]
        self.pending = []
        return events

    def clock(self) -> float:
        """The stages' time stands still: each answer comes at once, and no stage looks silent."""
        return 0.0


def stage(name: str, threads: int = 1) -> StageInfo:
    return StageInfo(name.encode(), name, "cpu", "float32", threads, None, "tcp://127.0.0.1:1", "box", 1, 0.0)


def profile(name: str, compute_share: float = 1.0) -> StageProfile:
    return StageProfile(name, 1e-3, 1e-2, 1e-4, 1e-3, 1 << 30, host="box", host_cores=2, compute_share=compute_share)


def factors(profiles: list[StageProfile]) -> dict[str, float]:
    return {p.name: p.corun_factor for p in profiles}


def test_the_second_plan_reads_the_factors_without_probing(tmp_path):
    stages, profiles = [stage("a"), stage("b")], [profile("a"), profile("b")]
    first = AnsweringControl()
    measured = measure_sharing(first, stages, profiles, REQUEST, 1.5, 10.0, cache_dir=tmp_path)
    assert first.sent == ["a", "b", "a", "b"] * 3, "each alone, then both at once, in three rounds"
    assert factors(measured) == {"a": pytest.approx(1.5), "b": pytest.approx(1.5)}
    [cached] = tmp_path.glob("corun-*.json")
    assert json.loads(cached.read_text())["factors"] == [pytest.approx(1.5)] * 2

    again = AnsweringControl()
    # Other names, other registration order: the same setups on the same host.
    renamed = measure_sharing(again, [stage("y"), stage("x")], [profile("x"), profile("y")], REQUEST, 1.5, 10.0,
                              cache_dir=tmp_path)
    assert again.sent == [] and factors(renamed) == {"x": pytest.approx(1.5), "y": pytest.approx(1.5)}


@pytest.mark.parametrize("change", ["threads", "emulated speed", "probe shapes", "host", "openmp wait policy"])
def test_a_changed_setup_probes_again(tmp_path, change, monkeypatch):
    measure_sharing(AnsweringControl(), [stage("a"), stage("b")], [profile("a"), profile("b")], REQUEST, 1.5, 10.0,
                    cache_dir=tmp_path)
    stages, profiles, request = [stage("a"), stage("b")], [profile("a"), profile("b")], REQUEST
    if change == "threads":
        stages[1] = stage("b", threads=2)
    elif change == "emulated speed":
        profiles[1] = profile("b", compute_share=0.2)
    elif change == "probe shapes":
        request = {**REQUEST, "micro_batch_size": 16}
    elif change == "openmp wait policy":  # stages whose threads spin cost each other more (models/openmp_waits.py)
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    else:
        stages = [replace(s, host="other") for s in stages]
        profiles = [replace(p, host="other") for p in profiles]
    control = AnsweringControl()
    measure_sharing(control, stages, profiles, request, 1.5, 10.0, cache_dir=tmp_path)
    assert sorted(control.sent) == ["a"] * 6 + ["b"] * 6, f"a changed {change} must be probed, not read from the cache"


@pytest.mark.parametrize("content", ["not json", '{"key": {}, "factors": [1.5, 1.5]}', "[]"])
def test_an_unreadable_or_foreign_cache_file_is_probed_again(tmp_path, content):
    measure_sharing(AnsweringControl(), [stage("a"), stage("b")], [profile("a"), profile("b")], REQUEST, 1.5, 10.0,
                    cache_dir=tmp_path)
    [cached] = tmp_path.glob("corun-*.json")
    cached.write_text(content)
    control = AnsweringControl()
    measure_sharing(control, [stage("a"), stage("b")], [profile("a"), profile("b")], REQUEST, 1.5, 10.0,
                    cache_dir=tmp_path)
    assert control.sent == ["a", "b", "a", "b"] * 3, "probed again"


class UnevenControl(AnsweringControl):
    """Answers the together probe with a different step time per stage (a short probe's noise)."""

    def __init__(self, together: dict[str, float]):
        super().__init__()
        self.together = together

    def poll(self, timeout_ms: int) -> list[ControlEvent]:
        if len(self.pending) == 1:
            return super().poll(timeout_ms)
        events = [ControlEvent(protocol.PROFILE_RESULT, name, {"probe_step_s": self.together[name]})
                  for name in self.pending]
        self.pending = []
        return events


def test_stages_set_up_alike_share_one_factor_the_mean_of_theirs(tmp_path):
    """Three alike stages measured 1.0x, 1.0x, 1.75x get 1.25x each; a stage set up otherwise (two
    threads) keeps its own. The cache holds the evened factors, and reads them back the same."""
    stages = [stage("a"), stage("b"), stage("c"), stage("d", threads=2)]
    profiles = [profile(name) for name in "abcd"]
    control = UnevenControl({"a": 1.0 * ALONE_S, "b": 1.0 * ALONE_S, "c": 1.75 * ALONE_S, "d": 1.3 * ALONE_S})
    measured = measure_sharing(control, stages, profiles, REQUEST, 1.5, 10.0, cache_dir=tmp_path)
    assert factors(measured) == {"a": pytest.approx(1.25), "b": pytest.approx(1.25), "c": pytest.approx(1.25),
                                 "d": pytest.approx(1.3)}
    again = AnsweringControl()
    cached = measure_sharing(again, stages, profiles, REQUEST, 1.5, 10.0, cache_dir=tmp_path)
    assert again.sent == [] and factors(cached) == factors(measured)


class BurstControl(AnsweringControl):
    """Answers the together probe of one round (`burst_round`) 3x slower: the host's other load came
    in a burst then. Records the probe's duration asked for."""

    def __init__(self, burst_round: int):
        super().__init__()
        self.burst_round, self.togethers, self.probe_s = burst_round, 0, []

    def send(self, stage: StageInfo, kind: str, **fields) -> None:
        super().send(stage, kind, **fields)
        self.probe_s.append(fields["probe_s"])

    def poll(self, timeout_ms: int) -> list[ControlEvent]:
        if len(self.pending) == 1:
            return super().poll(timeout_ms)
        burst = 3.0 if self.togethers == self.burst_round else 1.0
        self.togethers += 1
        events = [ControlEvent(protocol.PROFILE_RESULT, name, {"probe_step_s": TOGETHER_S * burst})
                  for name in self.pending]
        self.pending = []
        return events


@pytest.mark.parametrize("burst_round", [0, 1, 2])
def test_a_burst_of_load_in_one_round_does_not_move_the_factor(tmp_path, burst_round):
    control = BurstControl(burst_round)
    measured = measure_sharing(control, [stage("a"), stage("b")], [profile("a"), profile("b")], REQUEST, 1.5, 10.0,
                               cache_dir=tmp_path)
    assert factors(measured) == {"a": pytest.approx(1.5), "b": pytest.approx(1.5)}  # 4.5x in one round
    assert control.probe_s == [pytest.approx(0.5)] * 12, "the probe's time split over the rounds, not tripled"
    # One round alone (rounds=1) takes what it measured: the burst, where it falls in that round.
    single = measure_sharing(BurstControl(0), [stage("a"), stage("b")], [profile("a"), profile("b")], REQUEST, 1.5,
                             10.0, cache_dir=tmp_path / "single", rounds=1)
    assert factors(single) == {"a": pytest.approx(4.5), "b": pytest.approx(4.5)}


def test_a_cache_written_before_the_evening_is_read_evened(tmp_path):
    stages, profiles = [stage("a"), stage("b")], [profile("a"), profile("b")]
    measure_sharing(AnsweringControl(), stages, profiles, REQUEST, 1.5, 10.0, cache_dir=tmp_path)
    [cached] = tmp_path.glob("corun-*.json")
    stored = json.loads(cached.read_text())
    cached.write_text(json.dumps({**stored, "factors": [1.0, 1.8]}))
    assert factors(measure_sharing(AnsweringControl(), stages, profiles, REQUEST, 1.5, 10.0, cache_dir=tmp_path)) \
        == {"a": pytest.approx(1.4), "b": pytest.approx(1.4)}


def test_a_stage_that_joins_is_probed_beside_every_stage_already_on_its_machine(tiny_models, monkeypatch):
    """Broker.profile times only the stage it has no profile of, but probes the sharing over the whole
    machine again: the factors its host-mates had were measured without it. Nothing new: no probe."""
    from layerbus.broker import chain_keeper
    from layerbus.broker.broker import Broker, BrokerConfig
    from layerbus.broker.link_probing import LinkProbeConfig

    timed, probed, tick_shares = [], [], []

    def profile_steps(control, stage, request, probe_bytes, config):
        timed.append(stage.name)
        assert config.probe_s == 0, "timed alone; the co-run probe comes after, over the whole machine"
        return profile(stage.name)
        yield  # a conversation that needs no answer

    def measure(control, stages, profiles, request, probe_s, timeout_s, rounds, tick_layers, liveness):
        probed.append(sorted(s.name for s in stages))
        tick_shares.append(tick_layers)
        return [replace(p, corun_factor=1.5) for p in profiles]

    monkeypatch.setattr(chain_keeper, "profile_steps", profile_steps)
    monkeypatch.setattr(chain_keeper, "measure_sharing", measure)
    broker = Broker(BrokerConfig(str(tiny_models("llama")), 2, link_probe=LinkProbeConfig(enabled=False)))
    try:
        assert broker.profile([stage("a"), stage("b")])
        assert broker.profile([stage("a"), stage("b"), stage("c")])
        assert not broker.profile([stage("a"), stage("b"), stage("c")])
    finally:
        broker.close()
    assert timed == ["a", "b", "c"], "only a stage without a profile is timed"
    assert probed == [["a", "b"], ["a", "b", "c"]]
    layers = json.loads((tiny_models("llama") / "config.json").read_text())["num_hidden_layers"]
    assert tick_shares == [round(layers / 2), round(layers / 3)], "the probe in step runs a stage's share of the layers"
    assert factors(broker.profiles) == {"a": 1.5, "b": 1.5, "c": 1.5}


class TickControl(AnsweringControl):
    """Answers as AnsweringControl, and the probe in step with each stage's steps per tick: `ticks[name]`
    lists (tick, seconds) for a step of `repeats` held steps. Records the probes in step it was sent."""

    def __init__(self, ticks: dict[str, list[tuple[int, float]]], repeats: int = 2):
        super().__init__()
        self.ticks, self.repeats, self.in_step, self.starts = ticks, repeats, [], []

    def send(self, stage: StageInfo, kind: str, **fields) -> None:
        super().send(stage, kind, **fields)
        self.starts.append((stage.name, fields.get("probe_start", 0.0)))
        self.pending_in_step = bool(fields.get("tick_period_s"))
        if self.pending_in_step:
            self.in_step.append((stage.name, fields["tick_start"], fields["tick_period_s"], fields["tick_layers"]))

    def poll(self, timeout_ms: int) -> list[ControlEvent]:
        if not self.pending or not self.pending_in_step:
            return super().poll(timeout_ms)
        events = [ControlEvent(protocol.PROFILE_RESULT, name, {"probe_ticks": [list(t) for t in self.ticks[name]],
                                                               "probe_tick_repeats": self.repeats})
                  for name in self.pending]
        self.pending = []
        return events


def test_the_probe_in_step_measures_what_the_ring_waits_for_beyond_the_factors(tmp_path):
    # Alone a held step takes 10 ms, two of them make a tick's step; at their own pace together 1.5x: 30 ms.
    # In step, each tick one stage gets a core to itself (20 ms) and the other finishes late (34-38 ms);
    # tick 3 only stage a started: left out.
    ticks = {"a": [(0, 0.020), (1, 0.038), (2, 0.020), (3, 0.050)], "b": [(0, 0.034), (1, 0.020), (2, 0.036)]}
    control = TickControl(ticks)
    stages, profiles = [stage("a"), stage("b")], [profile("a"), profile("b")]
    measured = measure_sharing(control, stages, profiles, REQUEST, 1.5, 10.0, cache_dir=tmp_path, tick_layers=10)
    assert [p.lockstep_excess_s for p in measured] == [pytest.approx(0.006)] * 2  # median of 4, 8, 6 ms
    assert [name for name, *_ in control.in_step] == ["a", "b"] * 3, "both in step, once a round"
    together = [start for _, start in control.starts if start]
    assert len(together) == 6 and len(set(together)) == 3, "the two probed together start at one time, each round"
    starts = {(start, period, layers) for _, start, period, layers in control.in_step}
    assert len(starts) == 3 and {layers for _, _, layers in starts} == {10}
    # ticks as far apart as the slowest stage's 10 layers as profiled (10 x 1 ms) x (1 + 2 stages / 2 cores), + 5 ms
    assert [period for _, period, _ in starts] == [pytest.approx(0.010 * 2 + 0.005)] * 3
    again = TickControl(ticks)
    cached = measure_sharing(again, stages, profiles, REQUEST, 1.5, 10.0, cache_dir=tmp_path, tick_layers=10)
    assert again.sent == [] and [p.lockstep_excess_s for p in cached] == [pytest.approx(0.006)] * 2
    # Without tick_layers (a caller of before) no probe in step runs, and the cache is another one
    plain = TickControl(ticks)
    assert [p.lockstep_excess_s for p in measure_sharing(plain, stages, profiles, REQUEST, 1.5, 10.0,
                                                         cache_dir=tmp_path)] == [0.0, 0.0]
    assert plain.in_step == [] and len(plain.sent) == 12


@pytest.mark.parametrize("rounds, want", [
    # one round; two stages, 10 ms alone x 2 repeats x factor 1.5 = 30 ms paced; the ticks' slowest 34, 38, 36
    ([({"a": 0.01, "b": 0.01}, {"a": {"probe_ticks": [[0, 0.02], [1, 0.038], [2, 0.02]], "probe_tick_repeats": 2},
                                "b": {"probe_ticks": [[0, 0.034], [1, 0.02], [2, 0.036]], "probe_tick_repeats": 2}})],
     0.006),
    # in step no slower than at their own pace: no excess, not a negative one
    ([({"a": 0.01, "b": 0.01}, {"a": {"probe_ticks": [[0, 0.025]], "probe_tick_repeats": 2},
                                "b": {"probe_ticks": [[0, 0.025]], "probe_tick_repeats": 2}})], 0.0),
    # no tick both started; a stage that could not probe: nothing measured
    ([({"a": 0.01, "b": 0.01}, {"a": {"probe_ticks": [[0, 0.05]], "probe_tick_repeats": 2},
                                "b": {"probe_ticks": [[1, 0.05]], "probe_tick_repeats": 2}})], 0.0),
    ([({"a": 0.01, "b": 0.01}, {"a": {"probe_ticks": [[0, 0.05]], "probe_tick_repeats": 2}, "b": None})], 0.0),
    # three rounds, one a burst of other load: the median round counts
    ([({"a": 0.01, "b": 0.01}, {n: {"probe_ticks": [[0, took]], "probe_tick_repeats": 2} for n in "ab"})
      for took in (0.034, 0.09, 0.036)], 0.006),
], ids=["ticks", "no slower", "no shared tick", "a stage without", "median round"])
def test_lockstep_excess_table(rounds, want):
    assert lockstep_excess_s(rounds, {"a": 1.5, "b": 1.5}) == pytest.approx(want)


@pytest.mark.parametrize("ready, want", [
    ([0.01, 0.02], 0.05 + 2 * 0.02),  # twice the slowest to get ready alone, and 50 ms
    ([1.5], 3.05),  # a large model's layers take a while to load: the start waits for them
    ([0.01, None], UNKNOWN_LEAD_S), ([], UNKNOWN_LEAD_S), ([True], UNKNOWN_LEAD_S), (["0.1"], UNKNOWN_LEAD_S),
], ids=["ready", "slow to load", "one did not say", "none", "a bool", "a string"])
def test_the_start_in_common_waits_as_long_as_the_stages_took_to_get_ready(ready, want):
    assert _lead_s(ready) == pytest.approx(want)


class ReadyControl(TickControl):
    """Says, with each probe alone, that the stage was ready 10 ms after the request; records when each
    probe was sent."""

    def __init__(self):
        super().__init__({"a": [(0, 0.02)], "b": [(0, 0.02)]})
        self.sent_at = []

    def send(self, stage: StageInfo, kind: str, **fields) -> None:
        self.sent_at.append(time.time())
        super().send(stage, kind, **fields)

    def poll(self, timeout_ms: int) -> list[ControlEvent]:
        events = super().poll(timeout_ms)
        return [ControlEvent(e.kind, e.stage, {**e.header, "probe_ready_s": 0.01}) for e in events]


def test_stages_probed_together_start_as_soon_as_they_were_ready_alone(tmp_path):
    control = ReadyControl()
    measure_sharing(control, [stage("a"), stage("b")], [profile("a"), profile("b")], REQUEST, 1.5, 10.0,
                    cache_dir=tmp_path, tick_layers=10)
    lead = 0.05 + 2 * 0.01
    waits = [start - sent for (_, start), sent in zip(control.starts, control.sent_at) if start]
    assert len(waits) == 6 and all(0 < wait <= lead for wait in waits), waits  # not UNKNOWN_LEAD_S
