"""The broker's data-plane loop: keep every micro-batch moving through the chain of stages.

Each micro-batch has at most one step in flight. When its result comes back from the last stage,
the scheduler advances its sequences, finished ones are delivered, freed slots are refilled, and
the micro-batch's next step goes straight back to stage 0. With more micro-batches than stages,
every stage always has one to work on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import zmq

from broker.control import ClusterError, ControlPlane, StageInfo
from broker.requests import GenerationRequest, GenerationResult
from broker.scheduler import BatchingConfig, Scheduler, StepPlan
from stages.forward import StepRow
from wire import protocol
from wire.frames import DEFAULT_MAX_MESSAGE_BYTES, WireError, decode, encode

log = logging.getLogger("layerbus.broker")


class RequestSource(Protocol):
    """Where requests come from (a list, a job store). `fetch` never blocks for long."""

    def fetch(self, limit: int) -> list[GenerationRequest]: ...

    @property
    def exhausted(self) -> bool: ...


class ResultSink(Protocol):
    def deliver(self, results: list[GenerationResult]) -> None: ...


@dataclass(frozen=True)
class PipelineConfig:
    """Timing of the data-plane loop."""

    heartbeat_interval_s: float = 0.5  # broker -> stage heartbeats
    stage_timeout_s: float = 30.0  # a stage silent this long is declared dead
    step_timeout_s: float = 300.0  # a step not back after this long has been lost on the way
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger results are rejected


@dataclass
class RunStats:
    """What one run did, for status lines and benchmarks."""

    wall_s: float = 0.0
    broker_cpu_s: float = 0.0  # the broker process's own CPU time during the run
    steps: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    errors: int = 0
    stage_stats: dict[str, dict] = field(default_factory=dict)  # name -> the stage's last stats


@dataclass
class _InFlight:
    plan: StepPlan
    step: int
    sent_at: float


class ListSource:
    """A fixed list of requests (tests, benchmarks, `generate`)."""

    def __init__(self, requests: list[GenerationRequest]):
        self.pending = list(reversed(requests))

    def fetch(self, limit: int) -> list[GenerationRequest]:
        taken = []
        while self.pending and len(taken) < limit:
            taken.append(self.pending.pop())
        return taken

    @property
    def exhausted(self) -> bool:
        return not self.pending


class Pipeline:
    def __init__(self, context: zmq.Context, control: ControlPlane, chain: list[StageInfo],
                 results_socket: zmq.Socket, batching: BatchingConfig, eos_ids: set[int],
                 detokenize: Callable[[list[int]], str] | None = None,
                 config: PipelineConfig = PipelineConfig(), clock: Callable[[], float] = time.monotonic):
        self.control, self.chain, self.config, self.clock = control, chain, config, clock
        self.batching, self.eos_ids, self.detokenize = batching, eos_ids, detokenize
        self.results = results_socket
        self.push = context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(chain[0].data_address)
        self.next_step = 0

    def close(self) -> None:
        self.push.close(linger=0)

    def run(self, source: RequestSource, sink: ResultSink, should_stop: Callable[[], bool] = lambda: False) -> RunStats:
        """Serve requests from `source` until it is exhausted and nothing is in flight."""
        scheduler = Scheduler(self.batching, len(self.chain), self.eos_ids, self.detokenize)
        inflight: dict[int, _InFlight] = {}
        stats = RunStats()
        started, cpu_started = self.clock(), time.process_time()
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.control.socket, zmq.POLLIN)

        def deliver(finished: list[GenerationResult]) -> None:
            if finished:
                for result in finished:
                    stats.finished += 1
                    stats.errors += result.error is not None
                    stats.new_tokens += len(result.token_ids)
                    stats.prompt_tokens += result.prompt_tokens
                sink.deliver(finished)

        def top_up() -> None:
            wanted = scheduler.free_slots() + scheduler.config.num_slots // 2 - len(scheduler.waiting)
            if wanted > 0 and not source.exhausted:
                now = self.clock()
                deliver([r for r in (scheduler.submit(req, now) for req in source.fetch(wanted)) if r])

        while True:
            stopping = should_stop()
            if not stopping:
                top_up()
                for mb in range(scheduler.num_micro_batches):
                    if mb not in inflight:
                        self._send(scheduler, mb, inflight)
            if not inflight and (stopping or (scheduler.idle and source.exhausted)):
                break
            for socket in dict(poller.poll(50)):
                if socket is self.results:
                    self._receive_results(scheduler, inflight, deliver, stats)
                else:
                    self._handle_control(scheduler, inflight, deliver)
            self.control.heartbeat(self.config.heartbeat_interval_s)
            self._check_liveness(inflight)
        stats.wall_s = self.clock() - started
        stats.broker_cpu_s = time.process_time() - cpu_started
        stats.stage_stats = {s.name: dict(s.stats) for s in self.chain}
        return stats

    def _send(self, scheduler: Scheduler, mb: int, inflight: dict[int, _InFlight]) -> None:
        plan = scheduler.plan_step(mb, self.clock())
        if plan is None:
            return
        rows, tokens = [], []
        for row in plan.rows:
            request = scheduler.active[row.slot].request
            rows.append(StepRow(row.slot, row.start, len(row.tokens), row.emit, request.sampling.to_json(),
                                row.targets))
            tokens.extend(row.tokens)
        step = self.next_step
        self.next_step += 1
        header = {"kind": protocol.STEP, "mb": mb, "step": step, "attempt": 0, "epoch": self.control.epoch,
                  "rows": protocol.rows_to_json(rows), "release": plan.released}
        self.push.send_multipart(encode(header, {"tokens": torch.tensor(tokens, dtype=torch.int64)}), copy=False)
        inflight[mb] = _InFlight(plan, step, self.clock())

    def _receive_results(self, scheduler, inflight, deliver, stats) -> None:
        while self.results.poll(0):
            frames = self.results.recv_multipart(copy=False)
            try:
                message = decode(frames, self.config.max_message_bytes)
                header = message.header
                protocol.require_fields(header, "result", {"mb": int, "step": int, "tokens": list})
            except WireError as error:
                log.error("rejected a result message: %s", error)
                continue
            current = inflight.get(header["mb"])
            if current is None or current.step != header["step"]:
                log.warning("discarding a late or duplicate result for micro-batch %s step %s",
                            header["mb"], header["step"])
                continue
            del inflight[header["mb"]]
            stats.steps += 1
            tokens = {slot: (token, logprob) for slot, token, logprob in header["tokens"]}
            scores = {slot: values for slot, values in header.get("scores", [])}
            deliver(scheduler.apply_result(current.plan, tokens, self.clock(), scores))
            self._send(scheduler, header["mb"], inflight)

    def _handle_control(self, scheduler, inflight, deliver) -> None:
        for event in self.control.poll(0):
            if event.kind == "failure" and isinstance(event.header.get("mb"), int):
                current = inflight.get(event.header["mb"])
                if current is not None and current.step == event.header.get("step"):
                    del inflight[event.header["mb"]]
                    error = f"stage {event.stage}: {event.header.get('error')}"
                    deliver(scheduler.fail_step(current.plan, error, self.clock()))
            elif event.kind == "bye":
                raise ClusterError(f"stage {event.stage} left the pipeline while work was in flight")

    def _check_liveness(self, inflight: dict[int, _InFlight]) -> None:
        now = self.clock()
        for mb, current in inflight.items():
            if now - current.sent_at > self.config.step_timeout_s:
                raise ClusterError(f"step {current.step} of micro-batch {mb} has not come back after "
                                   f"{now - current.sent_at:.0f} s (stage logs say why)")
        for stage in self.chain:
            if now - stage.last_seen > self.config.stage_timeout_s:
                raise ClusterError(f"stage {stage.name} ({stage.data_address}) silent for "
                                   f"{now - stage.last_seen:.1f} s (limit {self.config.stage_timeout_s} s)")
