"""The broker's view of its stages for `layerbus top` (broker/stage_view.py): the load between two stats
reports as a pure function, and snapshots of real StageInfo records against a real Placement."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from layerbus.planner.chain import Placement
from layerbus.broker.control import StageInfo, StageState
from layerbus.broker.stage_view import StageRates, StageView, stage_rates
from layerbus.wire.spans import LayerRange


def stats(uptime: float, busy: float, steps: int, out: int, **more) -> dict:
    return {"uptime_s": uptime, "busy_s": busy, "steps": steps, "bytes_out": out, **more}


@pytest.mark.parametrize(("before", "after", "expected"), [
    # 2 s of its own clock, 1.5 s of it busy over 100 steps, 4 MB sent.
    (stats(10, 5, 400, 1_000_000), stats(12, 6.5, 500, 5_000_000), StageRates(0.75, 0.015, 2_000_000.0, None)),
    # bytes_in, where a stage reports it.
    (stats(10, 5, 400, 0, bytes_in=0), stats(14, 5, 400, 0, bytes_in=8_000_000), StageRates(0.0, None, 0.0, 2e6)),
    # Idle: no steps, no step time.
    (stats(10, 5, 400, 0), stats(11, 5, 400, 0), StageRates(0.0, None, 0.0, None)),
    # Busier than its clock (rounding of the two reports): capped at 1.
    (stats(10, 5, 1, 0), stats(11, 6.2, 2, 0), StageRates(1.0, 1.2, 0.0, None)),
    # No earlier report, the same report again, a restarted stage (its clock went back): nothing to measure.
    (None, stats(12, 6, 500, 0), None),
    (stats(12, 6, 500, 0), stats(12, 6, 500, 0), None),
    (stats(12, 6, 500, 0), stats(1, 0.1, 3, 0), None),
    # A report without a clock (an older stage) or with a bad one.
    ({"busy_s": 1}, {"busy_s": 2}, None),
    (stats(10, 5, 1, 0), stats(float("nan"), 6, 2, 0), None),
    # A field that went backwards or is missing on one side: that figure alone is unknown.
    (stats(10, 5, 400, 9), stats(12, 6, 500, 3), StageRates(0.5, 0.01, None, None)),
    ({"uptime_s": 10}, stats(12, 6, 500, 4), StageRates(None, None, None, None)),
])
def test_stage_rates(before, after, expected):
    rates = stage_rates(before, after)
    assert (asdict(rates) if rates else None) == (pytest.approx(asdict(expected)) if expected else None)


def info(name: str, pid: int = 1, **changes) -> StageInfo:
    fields = dict(identity=name.encode(), name=name, device="cpu", dtype="float32", threads=1,
                  memory_budget=2 << 30, data_address="tcp://127.0.0.1:1", host="box-a", pid=pid, last_seen=100.0,
                  state=StageState.READY, weights="fp32", peak_rss=300 << 20)
    return StageInfo(**{**fields, **changes})


def test_snapshots_take_spans_and_codecs_from_the_placement_and_load_from_successive_stats():
    placement = Placement(("stage-1", "stage-0"), (LayerRange(0, 10), LayerRange(10, 30)), codecs=("int8",))
    stage0, stage1, spare = info("stage-0"), info("stage-1"), info("spare", state=StageState.SPARE, weights="")
    view = StageView()
    stage1.stats = stats(10, 4, 100, 0, peak_rss=400 << 20)

    first = {s.stage: s for s in view.take([stage0, stage1, spare], placement, now=100.5)}

    assert (first["stage-1"].position, first["stage-1"].layer_start, first["stage-1"].layer_end) == (0, 0, 10)
    assert (first["stage-0"].position, first["stage-0"].layer_start, first["stage-0"].layer_end) == (1, 10, 30)
    assert (first["stage-1"].wire, first["stage-0"].wire) == ("int8", None)
    assert (first["spare"].position, first["spare"].layer_start, first["spare"].weights) == (None, None, None)
    assert first["stage-1"].busy_ratio is None, "one report: no interval to measure yet"
    assert first["stage-1"].peak_rss_bytes == 400 << 20, "the heartbeat's peak over the READY one"
    assert first["stage-0"].peak_rss_bytes == 300 << 20
    assert (first["stage-1"].memory_budget_bytes, first["stage-1"].heartbeat_age_s) == (2 << 30, 0.5)
    assert first["stage-1"].steps == 100 and first["stage-0"].steps is None

    stage1.stats = stats(12, 5, 200, 4_000_000)
    second = {s.stage: s for s in view.take([stage0, stage1, spare], placement, now=102.0)}
    assert (second["stage-1"].busy_ratio, second["stage-1"].step_s) == (0.5, 0.01)
    assert second["stage-1"].out_bytes_per_s == 2_000_000

    # No heartbeat since: no figure, and the next report is measured from the last one that was.
    none_new = {s.stage: s for s in view.take([stage1], placement, now=103.0)}
    assert none_new["stage-1"].busy_ratio is None
    stage1.stats = stats(14, 7, 300, 4_000_000)
    assert view.take([stage1], placement, now=104.0)[0].busy_ratio == 1.0


def test_a_restarted_stage_starts_a_new_baseline():
    placement = Placement(("stage-0",), (LayerRange(0, 30),))
    view = StageView()
    before = info("stage-0", pid=1, stats=stats(100, 50, 1000, 0))
    view.take([before], placement, now=100)
    again = info("stage-0", pid=2, stats=stats(2, 1, 10, 0))
    assert view.take([again], placement, now=101)[0].busy_ratio is None
    again.stats = stats(4, 2, 20, 0)
    assert view.take([again], placement, now=102)[0].busy_ratio == 0.5


def test_without_a_placement_every_stage_is_unplaced():
    snapshot = StageView().take([info("stage-0", state=StageState.LOADING)], None, now=101.0)[0]
    assert (snapshot.position, snapshot.layer_start, snapshot.wire, snapshot.state) == (None, None, None, "loading")
