"""A store as `layerbus top` reads it: one failed job and, newer, one running job with two stages' snapshots."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from layerbus.storage.snapshot_records import StageSnapshot
from layerbus.storage.store import JobStore
from tests.helpers.store_items import SETTINGS, new_items

BROKER = "box-a:4242:0a1b2c3d"


def stage(name: str, position: int, busy: float, **changes) -> StageSnapshot:
    fields = dict(stage=name, position=position, host="box-a", device="cpu", layer_start=position * 2,
                  layer_end=position * 2 + 2, weights="fp32", wire="float32" if position == 0 else None,
                  state="ready", busy_ratio=busy, step_s=0.0123, steps=812, tokens=9000, peak_rss_bytes=412 << 20,
                  memory_budget_bytes=2 << 30, bytes_out=10**8, out_bytes_per_s=2.1e6, heartbeat_age_s=0.3)
    return StageSnapshot(**{**fields, **changes})


def running_store(tmp_path: Path, busy: float = 0.93, url: str | None = None) -> tuple[str, str]:
    """A store (default: a SQLite file) with one failed job and, newer, one running job with two stages' snapshots."""
    url = url or f"sqlite:///{tmp_path / 'jobs.db'}"
    with JobStore.open(url) as store:
        earlier = store.create_job(SETTINGS, new_items(1), now=datetime.now(timezone.utc) - timedelta(hours=1))
        store.claim_items(earlier, "w", 1)
        job_id = store.create_job(SETTINGS, new_items(4))
        store.claim_items(job_id, BROKER, 2)
        store.record_stage_snapshots(job_id, BROKER, [stage("stage-1", 1, busy), stage("stage-0", 0, busy)])
        store.set_job_status(earlier, "failed", error="a test")
    return url, job_id
