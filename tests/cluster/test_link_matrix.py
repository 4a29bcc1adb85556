"""The measured link matrix: stages time the links between them at registration, with
wire/link_probe.py over their real data ports; the broker keeps every ordered pair, hands the matrix
to the planner, keeps it across re-plans and writes it into the job's events. Real stage processes
on tiny random-weight models, real ZeroMQ sockets; no figure is asserted beyond being a positive
number (timing depends on the machine's load)."""

from __future__ import annotations

import math
import re
import socket
from pathlib import Path

import pytest

from layerbus.broker.broker import BrokerConfig
from layerbus.broker.link_probing import LinkProbeConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.planner.network import BROKER, MEASURED
from layerbus.planner.placement import PlanOptions
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig

REPO = Path(__file__).resolve().parents[2]


# -- the stage's side, over real sockets in this process -------------------------------------------


# -- the matrix the planner gets (pure) -------------------------------------------------------------


# -- end to end: real stage processes ----------------------------------------------------------------


def _pairs(names) -> set[tuple[str, str]]:
    return {(a, b) for a in names for b in names if a != b}


def _lists(report: str, sender: str, receiver: str) -> bool:
    """The report has a line for this pair ("a [host] -> b [host]: ...")."""
    return re.search(rf"^  {re.escape(sender)}( \[[^]]*\])? -> {re.escape(receiver)}( \[[^]]*\])?: ", report, re.M) is not None


@pytest.mark.parametrize("secured", [False, True], ids=["plain", "curve"])
def test_stages_time_every_ordered_pair_and_the_planner_gets_them(tiny_models, tmp_path, secured) -> None:
    model_dir = tiny_models("llama", num_hidden_layers=6, hidden_size=64, intermediate_size=128)
    config = BrokerConfig(str(model_dir), 3, batching=BatchingConfig(num_slots=6, max_context=64))
    if secured:
        from layerbus.wire.curve import ClusterKeys, make_keypair, read_keypair

        keypair = read_keypair(make_keypair(tmp_path / "keys", "broker")[1])
        config = BrokerConfig(str(model_dir), 3, batching=BatchingConfig(num_slots=6, max_context=64),
                              keys=ClusterKeys(keypair))
    options = LocalStageOptions(threads_per_stage=1, env={"LAYERBUS_HOME": str(tmp_path)})
    with LocalCluster(config, options) as cluster:
        broker = cluster.broker
        names = [stage.name for stage in broker.control.live_stages()]
        assert set(broker.measured_links) == _pairs(names)
        for link in broker.measured_links.values():
            assert link.bytes_per_s > 0 and math.isfinite(link.bytes_per_s) and link.round_trip_s > 0
        network = broker.plan.network
        assert network is not None
        assert {pair for pair in network.links if BROKER not in pair} == _pairs(names)
        assert all(network.source(*pair) == MEASURED for pair in _pairs(names))
        report = broker.link_matrix_report()
        assert all(_lists(report, a, b) for a, b in _pairs(names)), report
        # The probes were never taken for steps: the job runs, nothing was rejected.
        results, _ = broker.generate([GenerationRequest(f"r{i}", [1, 4 + i, 7], max_new_tokens=3) for i in range(4)])
        assert all(r.error is None and r.token_ids for r in results)
        assert all(stage.stats.get("rejected", 0) == 0 for stage in broker.control.live_stages())


def test_no_link_probe_leaves_each_stage_its_own_link(tiny_models, tmp_path) -> None:
    model_dir = tiny_models("llama", num_hidden_layers=4, hidden_size=64, intermediate_size=128)
    config = BrokerConfig(str(model_dir), 2, batching=BatchingConfig(num_slots=4, max_context=64),
                          link_probe=LinkProbeConfig(enabled=False))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1, env={"LAYERBUS_HOME": str(tmp_path)})) as cluster:
        assert cluster.broker.measured_links == {} and cluster.broker.plan.network is None
        assert cluster.broker.link_matrix_report() == ""


def test_layerbus_run_writes_the_measured_matrix_into_the_jobs_events(tiny_models, tmp_path) -> None:
    """`layerbus run` on 2 stages: the job's events hold the matrix (`status --json`), and its stages their hosts."""
    from tests.helpers.cli import JOB_ID, layerbus, status_json, write_jsonl

    home = tmp_path / "home"
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": f"doc-{i}", "text": f"Item {i}."} for i in range(3)])
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    result = layerbus(home, "run", corpus, "--task", "summarize", "--model", tiny_models("llama"), "--stages", "2",
                      "--db", db, "--max-new-tokens", "2", "--max-context", "128", timeout=180)
    assert result.returncode == 0, result.stderr
    status = status_json(home, JOB_ID.search(result.stdout).group(), "--db", db)
    events = [e for e in status["events"] if e["kind"] == "links"]
    assert len(events) == 1, status["events"]
    message = events[0]["message"]
    assert _lists(message, "stage-0", "stage-1") and _lists(message, "stage-1", "stage-0"), message
    assert "(measured)" in message and "round trip" in message and _lists(message, "broker", "stage-0")
    # The chain's stages (the planner may leave one out of so small a model), each with its host.
    assert status["stages"] and all(s["host"] == socket.gethostname() for s in status["stages"]), status["stages"]
    # At the run's end, its plan's prediction against what it measured: a header, a line per stage of the
    # chain, and the run's line.
    (predicted,) = [e["message"] for e in status["events"] if e["kind"] == "predicted"]
    lines = predicted.splitlines()
    assert len(lines) == len(status["stages"]) + 2 and lines[0].startswith("stage "), predicted
    assert all(line.startswith("stage-") for line in lines[1:-1]), predicted
    assert lines[-1].startswith("run: ") and "tok/s predicted" in lines[-1] and "measured" in lines[-1], predicted


def test_a_replan_keeps_the_survivors_pairs_and_times_a_joining_stage(tiny_models, tmp_path) -> None:
    """stage-2 is killed and stage-new joins: the re-plan keeps stage-0 <-> stage-1 as measured at the
    start (not timed again), drops stage-2's pairs, times stage-new's, and reports the matrix."""
    import os
    import signal
    import subprocess
    import sys

    from layerbus.broker.control import StageLost

    model_dir = tiny_models("llama", num_hidden_layers=6, hidden_size=64, intermediate_size=128)
    config = BrokerConfig(str(model_dir), 3, batching=BatchingConfig(num_slots=6, max_context=64),
                          plan_options=PlanOptions(allow_drop=False))
    options = LocalStageOptions(threads_per_stage=1, env={"LAYERBUS_HOME": str(tmp_path)}, secure=False)
    joined = None
    with LocalCluster(config, options) as cluster:
        broker = cluster.broker
        before = dict(broker.measured_links)
        assert set(before) == _pairs(["stage-0", "stage-1", "stage-2"])
        joined = subprocess.Popen([sys.executable, "-m", "layerbus.stages", "--broker", broker.address,
                                   "--name", "stage-new", "--threads", "1"],
                                  env=dict(os.environ, LAYERBUS_HOME=str(tmp_path)),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            broker.control.wait_for_stages(4, 120.0)
            gone = broker.control.stage("stage-2")
            os.kill(cluster.processes[2].pid, signal.SIGKILL)
            events = []
            broker.recover(StageLost(gone, "killed by the test"), report=lambda kind, message, **_: events.append((kind, message)))
            after = broker.measured_links
            assert set(after) == _pairs(["stage-0", "stage-1", "stage-new"])
            assert after[("stage-0", "stage-1")] is before[("stage-0", "stage-1")]  # kept, not timed again
            assert after[("stage-1", "stage-0")] is before[("stage-1", "stage-0")]
            assert {pair for pair in broker.plan.network.links if BROKER not in pair} == set(after)
            links = [message for kind, message in events if kind == "links"]
            assert len(links) == 1 and _lists(links[0], "stage-new", "stage-0") and "stage-2" not in links[0], events
        finally:
            joined.terminate()
            joined.wait(10)


def test_plan_explain_on_local_stages_says_each_link_was_measured(tiny_models, tmp_path) -> None:
    from tests.helpers.cli import layerbus

    result = layerbus(tmp_path / "home", "plan", "--model", tiny_models("llama"), "--stages", "2", "--threads-per-stage",
                      "1", "--max-context", "128", "--keep-all", "--explain", timeout=180)
    assert result.returncode == 0, result.stderr
    hop = re.search(r"^  (stage-\d)( \[[^]]*\])? -> (stage-\d)( \[[^]]*\])?: .* \((measured)\)$", result.stdout, re.M)
    assert hop is not None and hop.group(1) != hop.group(3), result.stdout
