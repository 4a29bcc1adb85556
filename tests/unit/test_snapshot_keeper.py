"""The broker's stage snapshots written while a job runs (jobs/snapshot_keeper.py), against a real SQLite
store: written at the start and the end of a run, a failure logged once and never what stops the job."""

from __future__ import annotations

import logging

import pytest

from layerbus.jobs.runner import run_job
from layerbus.jobs.snapshot_keeper import SnapshotConfig, SnapshotKeeper
from layerbus.storage.snapshot_records import StageSnapshot
from tests.helpers.fixtures_jobs import store, tokenizer  # noqa: F401 - fixtures
from tests.helpers.scripted_broker import ScriptedBroker, queue_job

WORKER = "box-a:4242:0a1b2c3d"


def snapshot(name: str, steps: int) -> StageSnapshot:
    return StageSnapshot(stage=name, position=0, host="box-a", device="cpu", layer_start=0, layer_end=4,
                         weights="fp32", wire=None, state="ready", steps=steps)


class Counting:
    """A take() that reports one stage whose steps count the calls; raises once told to."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail: Exception | None = None

    def __call__(self) -> list[StageSnapshot]:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return [snapshot("stage-0", self.calls)]


def test_tick_replaces_the_brokers_rows(store):
    job_id = queue_job(store, 1)
    take = Counting()
    keeper = SnapshotKeeper(store, job_id, WORKER, take)
    assert keeper.tick() and keeper.tick()
    [row] = store.stage_snapshots(job_id)
    assert (row.stage, row.steps, row.broker) == ("stage-0", 2, WORKER) and row.updated_at is not None


def test_a_failure_is_logged_once_and_the_next_tick_tries_again(store, caplog):
    job_id = queue_job(store, 1)
    take = Counting()
    take.fail = RuntimeError("stage table changed")
    keeper = SnapshotKeeper(store, job_id, WORKER, take)
    with caplog.at_level(logging.WARNING, logger="layerbus.jobs"):
        assert not keeper.tick() and not keeper.tick()
    warnings = [r.getMessage() for r in caplog.records if "snapshot" in r.getMessage()]
    assert len(warnings) == 1 and "RuntimeError: stage table changed" in warnings[0]
    assert "the job goes on" in warnings[0]
    take.fail = None
    assert keeper.tick() and store.stage_snapshots(job_id)[0].steps == 3

    unknown = SnapshotKeeper(store, "job_missing", WORKER, Counting())
    with caplog.at_level(logging.WARNING, logger="layerbus.jobs"):
        assert not unknown.tick()
    assert "no job 'job_missing'" in caplog.records[-1].getMessage()


def test_the_thread_writes_as_the_run_starts_and_once_more_as_it_ends(store):
    job_id = queue_job(store, 1)
    take = Counting()
    with SnapshotKeeper(store, job_id, WORKER, take, SnapshotConfig(interval_s=3600)):
        pass
    assert take.calls == 2
    assert store.stage_snapshots(job_id)[0].steps == 2


def test_config_refuses_a_non_positive_interval():
    with pytest.raises(ValueError, match="interval_s=0 must be > 0 seconds"):
        SnapshotConfig(interval_s=0)


class SnapshottingBroker(ScriptedBroker):
    def __init__(self, tokenizer, fail: bool = False):
        super().__init__(tokenizer, batch=3)
        self.fail = fail

    def stage_snapshots(self) -> list[StageSnapshot]:
        if self.fail:
            raise RuntimeError("no view")
        return [snapshot("stage-0", len(self.requests))]


def test_run_job_leaves_the_runs_last_snapshot_in_the_store(store, tokenizer, tmp_path):
    job_id = queue_job(store, 5)
    status = run_job(store, job_id, SnapshottingBroker(tokenizer), tmp_path / "results", poll_cancel_s=0,
                     worker_name=WORKER)
    assert status.status == "completed"
    [row] = store.stage_snapshots(job_id)
    assert (row.broker, row.stage, row.steps) == (WORKER, "stage-0", 5), "taken after the last request"


def test_run_job_without_snapshots_or_with_a_failing_view_still_completes(store, tokenizer, tmp_path):
    off = queue_job(store, 2)
    status = run_job(store, off, SnapshottingBroker(tokenizer), tmp_path / "results", poll_cancel_s=0,
                     snapshots=SnapshotConfig(enabled=False))
    assert status.status == "completed" and store.stage_snapshots(off) == []

    failing = queue_job(store, 2)
    status = run_job(store, failing, SnapshottingBroker(tokenizer, fail=True), tmp_path / "results",
                     poll_cancel_s=0)
    assert status.status == "completed" and store.stage_snapshots(failing) == []
