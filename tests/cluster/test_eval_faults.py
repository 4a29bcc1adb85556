"""An eval survives a stage killed with SIGKILL mid-run: the samples file and the metrics equal an
unfaulted run's (accuracies exactly, log-likelihoods up to float rounding), and every document is
scored exactly once in the store."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.pipeline import PipelineConfig
from layerbus.planner.placement import PlanOptions
from layerbus.planner.batching import BatchingConfig
from layerbus.evals.encoding import Encoder
from layerbus.evals.eval_run import EvalOptions, finalize_eval, queue_eval, select_tasks
from layerbus.jobs.runner import run_job
from layerbus.models.model_info import load_tokenizer
from layerbus.storage import JobStore
from tests.helpers.cli import write_jsonl
from tests.helpers.faulted_runs import KillAfter

MAX_LENGTH = 64


def scored_run(model_dir: Path, tasks_dir: Path, work: Path, kill_after: int | None):
    db = f"sqlite:///{work / 'store.db'}"
    suite, tasks = select_tasks(EvalOptions(task_paths=tuple(str(p) for p in sorted(tasks_dir.iterdir()))))
    config = BrokerConfig(str(model_dir), 3, batching=BatchingConfig(num_slots=6, num_micro_batches=4,
                                                                      max_step_tokens=32, max_context=MAX_LENGTH),
                          pipeline=PipelineConfig(heartbeat_interval_s=0.2, liveness_window_s=1.5),
                          plan_options=PlanOptions(allow_drop=False))
    with JobStore.open(db) as store:
        job_id = queue_eval(store, model_dir, suite, tasks, Encoder(load_tokenizer(model_dir)), MAX_LENGTH,
                            {"model": str(model_dir)})
        with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
            broker = KillAfter(cluster, kill_after)
            status = run_job(store, job_id, broker, work / "results")
        assert status.status == "completed", status.error
        assert status.completed == status.total and status.failed == 0
        outcome = finalize_eval(store, job_id, work / "evals")
        attempts = [row for row in store.item_results(job_id)]
        assert len(attempts) == len({row["custom_id"] for row in attempts}), "every document once"
        metrics = [(m.task, m.metric, m.filter, m.value, m.stderr, m.n) for m in store.eval_metrics(job_id)]
    return broker.killed, pq.read_table(outcome.samples_path).to_pylist(), metrics


def test_killing_a_stage_mid_eval_changes_no_sample_and_no_metric(tiny_models, tmp_path):
    model_dir = tiny_models("llama", num_hidden_layers=6)
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    words = "the stage receives a batch of rows and sends hidden states to the next one in the chain".split()
    write_jsonl(tasks_dir / "mc.jsonl", [
        {"id": f"q{i}", "context": " ".join(words[i % 7:i % 7 + 6 + i % 5]),
         "choices": [" " + " ".join(words[(i + k) % 17:(i + k) % 17 + 1 + k % 3]) for k in range(4)], "gold": i % 4}
        for i in range(30)])
    write_jsonl(tasks_dir / "text.jsonl", [{"id": f"t{i}", "text": " ".join(words[i:] + words[:i]) * 3}
                                           for i in range(6)])
    _, unfaulted_samples, unfaulted_metrics = scored_run(model_dir, tasks_dir, tmp_path / "unfaulted", None)
    killed, samples, metrics = scored_run(model_dir, tasks_dir, tmp_path / "faulted", kill_after=8)
    assert killed, "the run ended before the fault was injected: make it longer"
    # Equal up to float rounding: after the re-plan, chunks share padded groups with other neighbours,
    # which changes the order of float additions (as lm-eval's batch size does). The bound is float32's: a
    # few ulps of the sum (rel 1e-6, 8 ulps of float32) beside 1e-5 absolute. 1e-5 alone was exceeded once
    # by 1.4e-9 (a sum of -19.48: 5e-7 relative, 4 ulps); a changed sample moves by orders of magnitude more.
    assert len(samples) == len(unfaulted_samples)
    for row, want in zip(samples, unfaulted_samples):
        assert {k: v for k, v in row.items() if k not in ("lls", "ll")} == \
            {k: v for k, v in want.items() if k not in ("lls", "ll")}
        assert row["lls"] == pytest.approx(want["lls"], abs=1e-5, rel=1e-6), row["doc_id"]
        assert (row["ll"] is None) == (want["ll"] is None)
        if row["ll"] is not None:
            assert row["ll"] == pytest.approx(want["ll"], abs=1e-5, rel=1e-6), row["doc_id"]
    assert [m[:3] + (m[5],) for m in metrics] == [m[:3] + (m[5],) for m in unfaulted_metrics]
    for (task, metric, _, value, stderr, _), want in zip(metrics, unfaulted_metrics):
        if metric in ("acc", "acc_norm"):
            assert (value, stderr) == (want[3], want[4]), (task, metric)
        else:
            assert value == pytest.approx(want[3], rel=1e-6) and stderr == pytest.approx(want[4], rel=1e-4)
