"""Runs on real stage processes (a LocalCluster) with a hook that may inject a fault mid-run: the requests,
the sink that collects every result once, and a broker stand-in for run_job that kills the chain's middle stage."""

from __future__ import annotations

import os
import signal

from transformers import AutoTokenizer

from layerbus.broker.broker import BrokerConfig
from layerbus.broker.pipeline import PipelineConfig
from layerbus.broker.profiling import ProfilingConfig
from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.broker.run_state import ListSource
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.placement import PlanOptions


FAST_LIVENESS = PipelineConfig(heartbeat_interval_s=0.2, liveness_window_s=1.5)


def make_requests(model_dir, count: int = 24, max_new_tokens: int = 40) -> list[GenerationRequest]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = "the stage receives a batch of rows and sends hidden states to the next one in the chain".split()
    requests = []
    for i in range(count):
        text = " ".join(words[(i * 3) % len(words):] + words[:(i * 3) % len(words)])[: 20 + 7 * (i % 9)]
        requests.append(GenerationRequest(f"r{i}", tokenizer.encode(text), max_new_tokens=max_new_tokens))
    return requests


class Collect:
    """A sink that runs `on_result(count)` after each delivery, to inject a fault mid-run."""

    def __init__(self, on_result=lambda count: None):
        self.results: dict[str, GenerationResult] = {}
        self.deliveries: list[str] = []
        self.on_result = on_result

    def deliver(self, results: list[GenerationResult]) -> None:
        for result in results:
            self.deliveries.append(result.request_id)
            self.results[result.request_id] = result
        self.on_result(len(self.deliveries))


def run(model_dir, requests, num_stages=3, on_result=lambda cluster, count: None, env=None, events=None,
        batching=BatchingConfig(num_slots=8, num_micro_batches=4, max_step_tokens=32), pipeline=FAST_LIVENESS,
        stage_args=(), secure=True, counts=None, reorder=True, profiling=ProfilingConfig()):
    # Every stage is used (no noisy profile gets one left out), so the faults hit the chain they aim at.
    # reorder=False: the chain keeps its order (by name; after a re-plan, the survivors' order), whatever
    # the profiles' noise says.
    config = BrokerConfig(str(model_dir), num_stages, batching=batching, pipeline=pipeline,
                          plan_options=PlanOptions(allow_drop=False, allow_reorder=reorder), profiling=profiling)
    options = LocalStageOptions(threads_per_stage=1, env=env or {}, stage_args=stage_args, secure=secure)
    with LocalCluster(config, options) as cluster:
        assert len(cluster.broker.chain) == num_stages, f"the plan left stages out: {cluster.broker.chain}"
        sink = Collect(lambda count: on_result(cluster, count))
        stats = cluster.broker.run(ListSource(requests), sink,
                                   events=(lambda kind, message, **fields: events.append((kind, message, fields)))
                                   if events is not None else None)
        if counts is not None:  # the broker's counters, which its metrics serve
            counts.append(cluster.broker.counts)
    assert sorted(sink.deliveries) == sorted(r.request_id for r in requests), "every request answered exactly once"
    return sink.results, stats


def outputs(results) -> dict[str, list[int]]:
    for result in results.values():
        assert result.error is None, f"{result.request_id}: {result.error}"
    return {rid: result.token_ids for rid, result in results.items()}


class KillAfter:
    """Plays the broker for run_job, killing the chain's middle stage after `after` results."""

    def __init__(self, cluster: LocalCluster, after: int | None):
        self.cluster, self.after, self.killed = cluster, after, []

    def tokenizer(self):
        return self.cluster.broker.tokenizer()

    def run(self, source, sink, should_stop, events=None):
        delivered = 0
        deliver = sink.deliver

        def deliver_and_maybe_kill(results):
            nonlocal delivered
            deliver(results)
            delivered += len(results)
            if self.after is not None and delivered >= self.after and not self.killed:
                process, name = process_of(self.cluster, 1)
                os.kill(process.pid, signal.SIGKILL)
                self.killed.append(name)

        sink.deliver = deliver_and_maybe_kill
        return self.cluster.broker.run(source, sink, should_stop, events)


def process_of(cluster, position: int):
    """The process of the stage at this position of the chain (LocalCluster names process i stage-i)."""
    name = cluster.broker.placement.stages[position]
    return cluster.processes[int(name.rsplit("-", 1)[1])], name


def kill_middle_after(results: int, killed: list[str]):
    """An on_result that sends SIGKILL to the chain's second stage once `results` results are in (once),
    noting its name in `killed`."""
    def kill_middle(cluster, count):
        if count >= results and not killed:
            process, name = process_of(cluster, 1)
            killed.append(name)
            os.kill(process.pid, signal.SIGKILL)

    return kill_middle
