"""Each registered stage as `layerbus top` shows it (storage StageSnapshots): its span and outgoing codec
from the placement in use, its state, host and memory from the control plane, and its load over the last
interval from two of its heartbeats' stats.

The load is a pure function of two stats reports (`stage_rates`); `StageView` keeps, per stage, the
report its last rates were measured to, so its one caller (jobs/snapshot_keeper.py) sees every interval
once. Stats fields a stage may not send (another layerbus, a field added later) are read with .get() and
left None, which `top` shows as "-".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from layerbus.planner.chain import Placement
from layerbus.broker.control import StageInfo
from layerbus.storage.snapshot_records import StageSnapshot


@dataclass(frozen=True)
class StageRates:
    """A stage's load between two of its stats reports."""

    busy_ratio: float | None  # share of the interval spent running steps, 0..1
    step_s: float | None  # mean seconds per step; None when it ran none
    out_bytes_per_s: float | None  # tensor bytes sent to the next hop per second
    in_bytes_per_s: float | None  # received, when the stage reports bytes_in


def stage_rates(before: Mapping | None, after: Mapping) -> StageRates | None:
    """The load between two stats reports (stages/worker.StageStats.to_json), timed by the stage's own
    clock (uptime_s), so how late its heartbeats reached the broker does not matter. None when there is
    no interval to measure: no earlier report, no time between them, or a stage that restarted (its
    clock and counters began again)."""
    if before is None:
        return None
    began, ended = _figure(before.get("uptime_s")), _figure(after.get("uptime_s"))
    if began is None or ended is None or ended <= began:
        return None
    seconds = ended - began

    def grown(key: str) -> float | None:
        old, new = _figure(before.get(key)), _figure(after.get(key))
        return new - old if old is not None and new is not None and new >= old else None

    busy, steps, sent, received = grown("busy_s"), grown("steps"), grown("bytes_out"), grown("bytes_in")
    return StageRates(
        busy_ratio=min(1.0, busy / seconds) if busy is not None else None,
        step_s=busy / steps if busy is not None and steps else None,
        out_bytes_per_s=sent / seconds if sent is not None else None,
        in_bytes_per_s=received / seconds if received is not None else None,
    )


class StageView:
    """Snapshots of a broker's stages, each with its load since the previous snapshot."""

    def __init__(self) -> None:
        # (name, pid) -> the stats report the stage's last rates were measured to: a restarted stage
        # (same name, new pid) starts a new baseline.
        self._baseline: dict[tuple[str, int], Mapping] = {}

    def take(self, stages: Iterable[StageInfo], placement: Placement | None, now: float) -> list[StageSnapshot]:
        """One snapshot per stage in `stages`, at control-plane clock `now`."""
        order = list(placement.stages) if placement is not None else []
        snapshots = []
        for stage in stages:
            stats = stage.stats  # replaced whole by the control plane at each heartbeat, never edited
            key = (stage.name, stage.pid)
            previous = self._baseline.get(key)
            rates = stage_rates(previous, stats)
            if rates is not None or previous is None or previous.get("uptime_s") != stats.get("uptime_s"):
                self._baseline[key] = stats  # no new report since the last snapshot: keep measuring from the old one
            position = order.index(stage.name) if stage.name in order else None
            snapshots.append(stage_snapshot(stage, placement, position, rates, now))
        return snapshots


def stage_snapshot(stage: StageInfo, placement: Placement | None, position: int | None,
                   rates: StageRates | None, now: float) -> StageSnapshot:
    """The snapshot of one stage at control-plane clock `now` (`position`: its place in `placement`'s chain)."""
    span = placement.spans[position] if placement is not None and position is not None else None
    codecs = placement.codecs if placement is not None else ()
    stats = stage.stats
    return StageSnapshot(
        stage=stage.name, position=position, host=stage.host, device=stage.device,
        layer_start=span.start if span else None, layer_end=span.end if span else None,
        weights=stage.weights or None,
        wire=codecs[position] if position is not None and position < len(codecs) else None,
        state=stage.state.value,
        busy_ratio=rates.busy_ratio if rates else None,
        step_s=rates.step_s if rates else None,
        steps=_count(stats.get("steps")),
        tokens=_count(stats.get("tokens")),
        rss_bytes=_count(stats.get("rss_bytes")),
        peak_rss_bytes=_count(stats.get("peak_rss")) or stage.peak_rss or None,
        memory_budget_bytes=stage.memory_budget,
        bytes_out=_count(stats.get("bytes_out")),
        bytes_in=_count(stats.get("bytes_in")),
        out_bytes_per_s=rates.out_bytes_per_s if rates else None,
        in_bytes_per_s=rates.in_bytes_per_s if rates else None,
        heartbeat_age_s=max(0.0, now - stage.last_seen),
    )


def _figure(value: object) -> float | None:
    """A reported number, or None for anything that is not a finite non-negative one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _count(value: object) -> int | None:
    figure = _figure(value)
    return int(figure) if figure is not None else None
