"""`--trace` on real stage processes: a run's trace is valid Trace Event Format, names every stage with its
layers, and its busy time per stage is what the run's stage stats say; `layerbus run --trace` interrupted
by Ctrl-C still leaves a valid trace of what ran."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig
from layerbus.wire.trace_events import BUSY_CATEGORIES
from tests.helpers.fixtures_cli import tiny  # noqa: F401 - fixture
from tests.helpers.cli import RUN_TIMEOUT_S, documents, start_run, wait_for_job, write_jsonl
from tests.helpers.trace import assert_valid_trace

BUSY_TOLERANCE = 0.05  # the bar; by construction the two agree to microseconds per step


def lanes(document: dict) -> dict[str, int]:
    """Process name's first word (the stage's name, or "broker") -> pid."""
    return {event["args"]["name"].split(" ")[0]: event["pid"] for event in document["traceEvents"]
            if event["ph"] == "M" and event["name"] == "process_name"}


def spans(document: dict, pid: int) -> list[dict]:
    return [event for event in document["traceEvents"] if event["ph"] == "X" and event["pid"] == pid]


def test_a_traced_runs_busy_time_per_stage_is_the_runs_stage_stats(tmp_path, tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    requests = [GenerationRequest(f"r{i}", tokenizer.encode(f"The stage receives batch {i} and sends it on."),
                                  max_new_tokens=12) for i in range(10)]
    path = tmp_path / "trace.json"
    config = BrokerConfig(str(tiny), 2, partition="equal", batching=BatchingConfig(num_slots=6, max_step_tokens=32),
                          trace=str(path))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
        results, stats = cluster.broker.generate(requests)
        chain = [(name, str(span)) for name, span in zip(cluster.broker.placement.stages, cluster.broker.spans)]
        written_after_run = json.loads(path.read_text())  # written at the end of the run, before the close
    assert all(result.error is None for result in results)

    document = json.loads(path.read_text())
    assert_valid_trace(document)
    assert_valid_trace(written_after_run)
    names = {event["args"]["name"] for event in document["traceEvents"] if event["name"] == "process_name"}
    assert names >= {f"{name} layers {span}" for name, span in chain}
    pids = lanes(document)
    for name, _ in chain:
        stage_spans = spans(document, pids[name])
        busy_s = sum(event["dur"] for event in stage_spans if event["cat"] in BUSY_CATEGORIES) / 1e6
        reported = stats.stage_stats[name]
        assert busy_s == pytest.approx(reported["busy_s"], rel=BUSY_TOLERANCE), (name, busy_s, reported)
        counts = Counter(event["name"] for event in stage_spans)
        assert counts["compute"] == counts["receive"] == reported["steps"] >= stats.steps
        assert counts["idle"] >= 1, "the gaps between a stage's steps are idle spans"
        assert {"mb", "step", "rows", "tokens"} <= set(stage_spans[0]["args"])
    broker = Counter(event["name"] for event in spans(document, pids["broker"]))
    assert broker["plan"] == broker["result"] == broker["apply"] == stats.steps
    assert broker["transmit"] == stats.steps + stats.resent
    assert broker["load spans"] == 1


def test_ctrl_c_leaves_a_valid_trace_of_what_ran(tmp_path, tiny):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(30))
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    log, path = tmp_path / "run.log", tmp_path / "run-trace.json"
    run = start_run(tmp_path / "home", log, corpus, "--task", "summarize", "--model", tiny, "--stages", "2",
                    "--db", db, "--max-new-tokens", "48", "--slots", "2", "--threads-per-stage", "1",
                    "--partition", "equal", "--trace", path)
    try:
        wait_for_job(db, lambda status: status.completed >= 1, "a completed item", run, log)
        run.send_signal(signal.SIGINT)
        assert run.wait(RUN_TIMEOUT_S) == 130, log.read_text()
    finally:
        run.kill()
    assert f"trace written to {path}" in log.read_text()
    document = json.loads(Path(path).read_text())
    assert_valid_trace(document)
    pids = lanes(document)
    assert set(pids) == {"broker", "stage-0", "stage-1"}
    for name in ("stage-0", "stage-1"):
        assert any(event["name"] == "compute" for event in spans(document, pids[name])), name
