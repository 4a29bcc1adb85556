"""One stage as its broker last saw it (the `stage_snapshots` table): what `layerbus top` shows.

The broker replaces its rows for a job every few seconds (jobs/snapshot_keeper.py), so a reader on any
machine that reaches the store sees each stage's span, load, memory and link without reaching the
broker. No SQLAlchemy here: the standard-library read path (storage/direct_status.py) builds these too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any

# Width of stage_snapshots.broker: a worker name "host:pid:token" (jobs/leases.py), cut to fit.
MAX_BROKER_CHARS = 200
# Width of stage_snapshots.state (a broker.control.StageState value).
MAX_STATE_CHARS = 16


@dataclass(frozen=True)
class StageSnapshot:
    """One stage of one broker at one moment. Figures a stage did not report are None (shown as "-")."""

    stage: str  # the stage's name
    position: int | None  # its place in the chain (0 embeds); None: registered but holds no span (spare, lost)
    host: str  # the machine it registered from
    device: str  # cpu, cuda:N, mps
    layer_start: int | None  # its layers [layer_start, layer_end); None without a span
    layer_end: int | None
    weights: str | None  # the weight format it reported loading ("fp32", "int4 (q4_1 g32)", ...)
    wire: str | None  # the codec of its outgoing link; None for the last stage (its results go to the broker)
    state: str  # spare, loading, ready, failed, gone, lost, reset (broker.control.StageState)
    busy_ratio: float | None = None  # share of the last interval it spent running steps, 0..1
    step_s: float | None = None  # mean seconds per step over the last interval
    steps: int | None = None  # steps run since it started
    tokens: int | None = None  # positions processed since it started
    rss_bytes: int | None = None  # resident memory now, when the stage reports it
    peak_rss_bytes: int | None = None  # peak resident memory
    memory_budget_bytes: int | None = None  # the memory it may use (its --memory-budget, or free memory)
    bytes_out: int | None = None  # tensor bytes sent to the next hop since it started
    bytes_in: int | None = None  # tensor bytes received, when the stage reports it
    out_bytes_per_s: float | None = None  # over the last interval
    in_bytes_per_s: float | None = None
    heartbeat_age_s: float | None = None  # seconds since the broker last heard from it
    broker: str = ""  # the broker that wrote it ("host:pid:token"); set by the store
    updated_at: datetime | None = None  # when that broker wrote it; set by the store


# Columns of stage_snapshots in the order of StageSnapshot's fields, job_id first.
SNAPSHOT_FIELDS = tuple(f.name for f in fields(StageSnapshot))
SNAPSHOT_COLUMNS = ("job_id", *SNAPSHOT_FIELDS)


def snapshot_row(job_id: str, broker: str, snapshot: StageSnapshot, now: datetime) -> dict[str, Any]:
    """The stage_snapshots row of `snapshot`, written by `broker` at `now`."""
    row = asdict(snapshot)
    row.update(job_id=job_id, broker=broker[:MAX_BROKER_CHARS], updated_at=now,
               state=snapshot.state[:MAX_STATE_CHARS])
    return row


def snapshot_from_row(row: Mapping[str, Any]) -> StageSnapshot:
    """A StageSnapshot from a stage_snapshots row (any mapping with its columns)."""
    return StageSnapshot(**{name: row[name] for name in SNAPSHOT_FIELDS})


def snapshot_order(snapshot: StageSnapshot) -> tuple:
    """How `top` lists a job's stages: by broker, then the chain in order, then the rest by name."""
    return (snapshot.broker, snapshot.position is None, snapshot.position or 0, snapshot.stage)
