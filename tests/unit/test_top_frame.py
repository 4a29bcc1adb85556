"""`layerbus top`'s frame (cli/top_frame.py) as a pure function: rows, clock and width in, text out."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from layerbus.cli.top_frame import COLUMNS, progress_bar, stage_cells, top_frame
from layerbus.storage.records import JobStatus
from layerbus.storage.snapshot_records import StageSnapshot

NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
GIB = 1 << 30


def job(**changes) -> JobStatus:
    counts = {"queued": 20, "in_progress": 8, "completed": 11, "failed": 1, "cancelled": 0}
    fields = dict(job_id="job_0123456789ab", name="nightly", task="summarize", model="tiny", status="in_progress",
                  timestamps={}, total=40, counts=counts, completed=11, failed=1, cancelled=0, queued=20,
                  in_progress=8, prompt_tokens=5000, completion_tokens=1234, tokens_per_s=52.34, eta_s=80.0,
                  results_path=None, error=None)
    return JobStatus(**{**fields, **changes})


def stage(name: str = "stage-0", **changes) -> StageSnapshot:
    fields = dict(stage=name, position=0, host="box-a", device="cpu", layer_start=0, layer_end=15, weights="fp32",
                  wire="int8", state="ready", busy_ratio=0.934, step_s=0.01243, steps=812, tokens=9000,
                  rss_bytes=412 * (1 << 20), peak_rss_bytes=500 * (1 << 20), memory_budget_bytes=3 * GIB // 2,
                  bytes_out=10**9, bytes_in=None, out_bytes_per_s=2_104_000.0, in_bytes_per_s=None,
                  heartbeat_age_s=0.31, broker="box-a:123:ab", updated_at=NOW - timedelta(seconds=1.2))
    return StageSnapshot(**{**fields, **changes})


@pytest.mark.parametrize(("snapshot", "expected"), [
    (stage(), ("stage-0", "box-a", "[0, 15)", "fp32", "int8", "ready", "93%", "12.4", "812", "412M/1.5G",
               "2.10", "-", "0.3s")),
    # The last stage: no outgoing codec. A stage that reports no current memory shows its peak.
    (stage("stage-1", position=1, layer_start=15, layer_end=30, wire=None, rss_bytes=None, busy_ratio=1.0,
           out_bytes_per_s=123_456_789.0, in_bytes_per_s=15_500_000.0),
     ("stage-1", "box-a", "[15, 30)", "fp32", "-", "ready", "100%", "12.4", "812", "500M/1.5G", "123", "15.5",
      "0.3s")),
    # A spare that has reported nothing yet: every figure it did not send is "-".
    (stage("spare", position=None, layer_start=None, layer_end=None, weights=None, wire=None, state="spare",
           busy_ratio=None, step_s=None, steps=None, rss_bytes=None, peak_rss_bytes=None, memory_budget_bytes=None,
           out_bytes_per_s=None, heartbeat_age_s=75.0),
     ("spare", "box-a", "-", "-", "-", "spare", "-", "-", "-", "-", "-", "-", "1m15s")),
    # Memory without a budget (a stage given none reports none), in binary units.
    (stage(rss_bytes=9 * 1024 + 512, memory_budget_bytes=None), None),
])
def test_stage_cells(snapshot, expected):
    cells = stage_cells(snapshot)
    assert len(cells) == len(COLUMNS)
    if expected is None:
        assert cells[COLUMNS.index("MEM/BUDGET")] == "9.5K/-"
    else:
        assert cells == expected


@pytest.mark.parametrize(("done", "total", "bar"), [
    (0, 40, "[....................]   0%"),
    (12, 40, "[######..............]  30%"),
    (40, 40, "[####################] 100%"),
    (0, 0, "[....................]   0%"),  # a job with no items yet
])
def test_progress_bar(done, total, bar):
    assert progress_bar(done, total) == bar


def test_frame_has_the_job_then_one_table_of_its_stages_in_chain_order():
    stages = [stage(), stage("stage-1", position=1, layer_start=15, layer_end=30, wire=None)]

    frame = top_frame(job(), stages, NOW)

    lines = frame.splitlines()
    assert lines[0] == "layerbus top  job_0123456789ab (nightly)  in_progress  2030-01-02 03:04:05 UTC"
    assert lines[1] == ("items   [######..............]  30% 12/40 done: 11 completed, 1 failed, 0 cancelled, "
                        "8 in progress, 20 queued")
    assert lines[2] == "tokens  1,234 generated, 5,000 prompt, 52.3 tok/s  eta 1m20s"
    assert lines[4] == "broker box-a:123:ab  snapshot 1.2s old"
    assert lines[5].split() == ["STAGE", "HOST", "LAYERS", "WEIGHTS", "WIRE", "STATE", "BUSY", "STEP", "ms", "STEPS",
                                "MEM/BUDGET", "OUT", "MB/s", "IN", "MB/s", "HEARD"]
    assert lines[6].startswith("stage-0  box-a  [0, 15)   fp32     int8  ready")
    assert lines[7].startswith("stage-1  box-a  [15, 30)  fp32     -     ready")
    assert lines[5].index("HEARD") + len("HEARD") == len(lines[6]), "figures are right-aligned under their header"


def test_a_broker_that_stopped_writing_is_shown_stale():
    old = [stage(updated_at=NOW - timedelta(seconds=42))]
    fresh = [stage("stage-9", broker="box-b:9:cd", updated_at=NOW - timedelta(seconds=1))]

    lines = top_frame(job(), old + fresh, NOW, stale_after_s=10).splitlines()

    assert "broker box-a:123:ab  snapshot 42.0s old: stale (over 10 s), its broker stopped writing" in lines
    assert "broker box-b:9:cd  snapshot 1.0s old" in lines
    states = {line.split()[0]: line.split()[6] for line in lines if line.startswith("stage-")}
    assert states == {"stage-0": "stale", "stage-9": "ready"}


def test_finished_job_without_snapshots_says_where_they_come_from():
    frame = top_frame(job(status="completed", eta_s=None, tokens_per_s=None, queued=0, in_progress=0,
                          completed=39), [], NOW)
    assert "completed" in frame.splitlines()[0]
    assert frame.splitlines()[2] == "tokens  1,234 generated, 5,000 prompt"
    assert "no stage snapshots: the job's broker writes them every few seconds while it runs" in frame


def test_lines_are_cut_to_the_width():
    frame = top_frame(job(), [stage()], NOW, width=30)
    assert max(len(line) for line in frame.splitlines()) == 30
    assert top_frame(job(), [stage()], NOW, width=30).splitlines()[0] == "layerbus top  job_0123456789ab"


def test_unnamed_job_and_missing_figures():
    frame = top_frame(job(name=""), [replace(stage(), busy_ratio=None, step_s=None)], NOW)
    assert frame.splitlines()[0].startswith("layerbus top  job_0123456789ab  in_progress")
    assert frame.splitlines()[-1].split()[7:10] == ["-", "-", "812"]
