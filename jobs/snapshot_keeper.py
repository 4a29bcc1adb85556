"""Writes the broker's stage snapshots into the store while a job runs, for `layerbus top` on any machine
that reaches the store.

From a thread of its own: a write may wait on the store (SQLite's busy timeout while another process
writes, a PostgreSQL round trip) and must never hold up the broker's loop; and a failed write is logged,
never what stops the job. It writes when the run starts, every `interval_s`, and once more at its end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from layerbus.storage import JobStore
from layerbus.storage.snapshot_records import StageSnapshot

log = logging.getLogger("layerbus.jobs")


@dataclass(frozen=True)
class SnapshotConfig:
    """How often a broker records what its stages are doing (the `stage_snapshots` table)."""

    # Seconds between two writes: fresh enough to watch, one small transaction per interval. Stage
    # rates (busy, step time, MB/s) are measured over the same interval.
    interval_s: float = 2.0
    # False: no snapshots (`layerbus top` then shows the job's progress only); for side-by-side benchmarks.
    enabled: bool = True

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"SnapshotConfig.interval_s={self.interval_s!r} must be > 0 seconds")


class SnapshotKeeper:
    """`with SnapshotKeeper(...):` records `take()` as `broker`'s snapshot of the job until the block ends;
    `tick()` is one round, for tests."""

    def __init__(self, store: JobStore, job_id: str, broker: str, take: Callable[[], list[StageSnapshot]],
                 config: SnapshotConfig = SnapshotConfig()):
        self.store, self.job_id, self.broker, self.take, self.config = store, job_id, broker, take, config
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"snapshots-{job_id}", daemon=True)
        self._last_error: str | None = None

    def __enter__(self) -> SnapshotKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        # Bounded: the last write may wait on a busy store, and leaving must not.
        self._thread.join(timeout=max(10.0, 2 * self.config.interval_s))

    def tick(self) -> bool:
        """Take and record one snapshot; False (the error logged once, not at every interval) when that failed."""
        try:
            self.store.record_stage_snapshots(self.job_id, self.broker, self.take())
        except Exception as error:  # noqa: BLE001 (a view of the run must never be what stops it)
            described = f"{type(error).__name__}: {error}"
            if described != self._last_error:
                log.warning("job %s: could not record the stages' snapshot for `layerbus top` (%s); the job goes "
                            "on, and the next interval tries again", self.job_id, described)
            self._last_error = described
            return False
        self._last_error = None
        return True

    def _loop(self) -> None:
        self.tick()
        while not self._stop.wait(self.config.interval_s):
            self.tick()
        self.tick()  # the run's last figures (its final step counts), stamped as it ends
