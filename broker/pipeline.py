"""The broker's data-plane loop: keep every micro-batch moving through the chain of stages.

Each micro-batch has at most one step in flight. When its result comes back from the last stage,
the scheduler advances its sequences, finished ones are delivered, freed slots are refilled, and
the micro-batch's next step goes straight back to stage 0. With more micro-batches than stages,
every stage always has one to work on.

Faults. Every step is stamped (epoch, step, attempt); a result that does not match what is in
flight (late, duplicate, from before a re-plan) is discarded. A step not back after
`step_timeout_s` is resent with the next attempt number (PUSH/PULL has no acknowledgements: a
message queued to a peer that died is gone). A stage silent past the liveness window, stuck in one
step, or gone is lost: the in-flight steps are dropped, `recover` re-plans over the stages left
(waiting for one to join if they cannot hold the model) and they load their new spans; then every
active sequence re-prefills its prompt and the tokens generated so far, and goes on. Generated
tokens are kept, and sampling depends only on (seed, position), so outputs do not change.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import zmq

from layerbus.broker.control import ClusterError, ControlPlane, StageInfo, StageLost
from layerbus.broker.drift import DriftConfig, DriftWatch, Expected, Work
from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.broker.scheduler import BatchingConfig, Scheduler, StepPlan
from layerbus.wire import protocol
from layerbus.wire.frames import DEFAULT_MAX_MESSAGE_BYTES, WireError, decode, encode
from layerbus.wire.protocol import StepRow

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

    heartbeat_interval_s: float = 0.5  # broker -> stage heartbeats (stages send theirs as often)
    liveness_window_s: float = 5.0  # a stage silent this long (no heartbeat, no message) is lost
    stuck_step_s: float = 300.0  # a stage whose heartbeats say one step has run this long is lost
    step_timeout_s: float = 60.0  # a step not back after this long is resent (next attempt)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger results are rejected
    drift: DriftConfig = field(default_factory=DriftConfig)  # when a slowed stage has layers moved off it

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.liveness_window_s:
            raise ValueError(f"need 0 < heartbeat interval ({self.heartbeat_interval_s} s) < liveness window "
                             f"({self.liveness_window_s} s): a live stage must get several heartbeats in per window")
        if self.step_timeout_s <= 0 or self.stuck_step_s <= 0:
            raise ValueError(f"step_timeout_s and stuck_step_s must be > 0, got {self.step_timeout_s}, "
                             f"{self.stuck_step_s}")


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
    resent: int = 0  # steps sent again after step_timeout_s or a failed send
    discarded: int = 0  # late or duplicate results (from before a re-plan, or of an older attempt)
    stage_stats: dict[str, dict] = field(default_factory=dict)  # name -> the stage's last stats
    recoveries: list[dict] = field(default_factory=list)  # one event per lost stage (see Pipeline._recover)
    # (clock, new tokens so far) after every step that emitted tokens: throughput over any window.
    progress: list[tuple[float, int]] = field(default_factory=list)
    source_exhausted_at: float | None = None  # clock when the last request was taken from the source


@dataclass
class _InFlight:
    plan: StepPlan
    step: int
    attempt: int
    sent_at: float


# recover(lost, should_stop, report) -> the new chain, loaded and ready, or None when asked to stop.
Recover = Callable[[StageLost, Callable[[], bool], Callable[..., None]], "list[StageInfo] | None"]
# rebalance({stage: slowdown factor}, report) -> a new chain, loaded and ready, or None: no better plan.
Rebalance = Callable[[dict, Callable[..., None]], "list[StageInfo] | None"]
# report(kind, message, **fields): a fault-handling event (stage_lost, waiting, recovered, ...).
EventSink = Callable[..., None]

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
                 config: PipelineConfig = PipelineConfig(), clock: Callable[[], float] = time.monotonic,
                 recover: Recover | None = None, rebalance: Rebalance | None = None,
                 expected: Expected | None = None):
        self.control, self.chain, self.config, self.clock = control, chain, config, clock
        self.batching, self.eos_ids, self.detokenize = batching, eos_ids, detokenize
        self.recover = recover  # None: a lost stage ends the run with ClusterError
        self.rebalance = rebalance  # None: a slowed stage keeps its layers
        self.drift = DriftWatch(config.drift, expected)  # expected: each stage's price of the work sent
        self.work = Work()  # what has been sent down the chain, for the drift watch
        self.results = results_socket
        self.context = context
        self.push: zmq.Socket | None = None
        self.first_address: str | None = None
        self.use_chain(chain)
        self.next_step = 0
        self._awaiting_first_token: dict | None = None  # the recovery event waiting for its first new token
        self._replay_event: dict | None = None  # the recovery event waiting for its re-prefill to end

    def use_chain(self, chain: list[StageInfo]) -> None:
        """Send to a new chain (after a re-plan)."""
        self.chain = chain
        # Decided once per chain, not per loop: CPU stages sharing one host are not watched for drift.
        self._drift_watched = self.config.drift.watch_shared_cpu_host or not _shared_cpu_host(chain)
        if chain[0].data_address != self.first_address:
            self._connect_first(chain[0].data_address)

    def _connect_first(self, address: str) -> None:
        if self.push is not None:
            self.push.close(linger=0)
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(address)
        self.first_address = address

    def close(self) -> None:
        self.push.close(linger=0)

    def run(self, source: RequestSource, sink: ResultSink, should_stop: Callable[[], bool] = lambda: False,
            events: EventSink | None = None) -> RunStats:
        """Serve requests from `source` until it is exhausted and nothing is in flight. `events`
        hears of every lost stage, wait and recovery (the job runner records them in the store)."""
        scheduler = Scheduler(self.batching, len(self.chain), self.eos_ids, self.detokenize)
        inflight: dict[int, _InFlight] = {}
        stats = RunStats()
        started, cpu_started = self.clock(), time.process_time()
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.control.socket, zmq.POLLIN)
        self.drift.restart(self.clock(), self._stage_stats(), self.work)

        def report(kind: str, message: str, **fields) -> None:
            log.warning("%s: %s", kind, message)
            if events is not None:
                events(kind, message, **fields)

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
                if source.exhausted and stats.source_exhausted_at is None:
                    stats.source_exhausted_at = self.clock()

        while True:
            stopping = should_stop()
            if not stopping:
                top_up()
                for mb in range(scheduler.num_micro_batches):
                    if mb not in inflight:
                        self._send(scheduler, mb, inflight)
            if not inflight and (stopping or (scheduler.idle and source.exhausted)):
                break
            try:
                for socket in dict(poller.poll(50)):
                    if socket is self.results:
                        self._receive_results(scheduler, inflight, deliver, stats, report)
                    else:
                        self._handle_control(scheduler, inflight, deliver, stats)
                self.control.heartbeat(self.config.heartbeat_interval_s)
                self._resend_overdue(scheduler, inflight, stats)
                self.control.check_liveness(self.chain, self.config.liveness_window_s, self.config.stuck_step_s)
                self._watch_speed(scheduler, inflight, report, stats)
            except StageLost as lost:
                if not self._recover(scheduler, inflight, lost, should_stop, report, stats):
                    break  # asked to stop while waiting for stages: the caller hands the items back
        stats.wall_s = self.clock() - started
        stats.broker_cpu_s = time.process_time() - cpu_started
        stats.stage_stats = {s.name: dict(s.stats) for s in self.chain}
        return stats

    # -- sending -------------------------------------------------------------------------------
    def _send(self, scheduler: Scheduler, mb: int, inflight: dict[int, _InFlight]) -> None:
        plan = scheduler.plan_step(mb, self.clock())
        if plan is None:
            return
        step = self.next_step
        self.next_step += 1
        self._transmit(scheduler, plan, step, 0)
        inflight[mb] = _InFlight(plan, step, 0, self.clock())

    def _transmit(self, scheduler: Scheduler, plan: StepPlan, step: int, attempt: int) -> None:
        rows, tokens = [], []
        for row in plan.rows:
            request = scheduler.active[row.slot].request
            rows.append(StepRow(row.slot, row.start, len(row.tokens), row.emit, request.sampling.to_json(),
                                row.targets))
            tokens.extend(row.tokens)
        prefill = sum(len(row.tokens) for row in plan.rows if len(row.tokens) > 1)
        self.work = Work(self.work.steps + 1, self.work.decode_rows + sum(len(row.tokens) == 1 for row in plan.rows),
                         self.work.prefill_tokens + prefill, self.work.emit_rows + sum(row.emit for row in plan.rows))
        header = {"kind": protocol.STEP, "mb": plan.micro_batch, "step": step, "attempt": attempt,
                  "epoch": self.control.epoch, "rows": protocol.rows_to_json(rows), "release": plan.released}
        self.push.send_multipart(encode(header, {"tokens": torch.tensor(tokens, dtype=torch.int64)}), copy=False)

    def _resend(self, scheduler: Scheduler, current: _InFlight, stats: RunStats) -> None:
        """Send a step again, same rows, next attempt: replaying a step rewrites the same cache positions."""
        current.attempt += 1
        current.sent_at = self.clock()
        stats.resent += 1
        self._transmit(scheduler, current.plan, current.step, current.attempt)

    def _resend_overdue(self, scheduler: Scheduler, inflight: dict[int, _InFlight], stats: RunStats) -> None:
        now = self.clock()
        for mb, current in inflight.items():
            if now - current.sent_at > self.config.step_timeout_s:
                log.warning("step %d of micro-batch %d not back after %.0f s: sending attempt %d",
                            current.step, mb, now - current.sent_at, current.attempt + 1)
                self._resend(scheduler, current, stats)

    # -- receiving -----------------------------------------------------------------------------
    def _receive_results(self, scheduler, inflight, deliver, stats, report) -> None:
        while self.results.poll(0):
            frames = self.results.recv_multipart(copy=False)
            try:
                message = decode(frames, self.config.max_message_bytes)
                header = message.header
                protocol.require_fields(header, "result", {"mb": int, "step": int, "attempt": int, "epoch": int,
                                                           "tokens": list})
            except WireError as error:
                log.error("rejected a result message: %s", error)
                continue
            current = inflight.get(header["mb"])
            if (current is None or header["epoch"] != self.control.epoch or current.step != header["step"]
                    or current.attempt != header["attempt"]):
                log.info("discarding a late or duplicate result: micro-batch %s step %s attempt %s epoch %s",
                         header["mb"], header["step"], header["attempt"], header["epoch"])
                stats.discarded += 1
                continue
            del inflight[header["mb"]]
            stats.steps += 1
            tokens = {slot: (token, logprob) for slot, token, logprob in header["tokens"]}
            scores = {slot: values for slot, values in header.get("scores", [])}
            deliver(scheduler.apply_result(current.plan, tokens, self.clock(), scores))
            if tokens:
                emitted = (stats.progress[-1][1] if stats.progress else 0) + len(tokens)
                stats.progress.append((self.clock(), emitted))
            if self._replay_event is not None and not scheduler.replaying:
                event, self._replay_event = self._replay_event, None
                event["reprefill_s"] = round(self.clock() - event["started"], 3)
                report("reprefilled", f"every sequence's cache rebuilt ({event['reprefill_tokens']} tokens) "
                                      f"{event['reprefill_s']:.2f} s after the re-plan began",
                       duration_s=event["reprefill_s"])
            if tokens and self._awaiting_first_token is not None:
                event, self._awaiting_first_token = self._awaiting_first_token, None
                event["first_token_s"] = round(self.clock() - event["started"], 3)
                report("first_token", f"first new token {event['first_token_s']:.2f} s after the re-plan began "
                                      f"({event['stage']})", stage=event["stage"], duration_s=event["first_token_s"])
            self._send(scheduler, header["mb"], inflight)

    def _handle_control(self, scheduler, inflight, deliver, stats) -> None:
        chain_names = {stage.name for stage in self.chain}
        for event in self.control.poll(0):
            if event.kind == "failure" and isinstance(event.header.get("mb"), int):
                current = inflight.get(event.header["mb"])
                if (current is None or current.step != event.header.get("step")
                        or event.header.get("epoch") != self.control.epoch
                        or event.header.get("attempt", current.attempt) != current.attempt):
                    continue  # about a step already settled
                if event.header.get("cause") == "send":
                    self._resend(scheduler, current, stats)  # the next hop is the problem, not the items
                    continue
                del inflight[event.header["mb"]]
                error = f"stage {event.stage}: {event.header.get('error')}"
                deliver(scheduler.fail_step(current.plan, error, self.clock()))
            elif event.kind == "failure" and event.stage in chain_names:  # not about a step: the stage is down
                stage = next(s for s in self.chain if s.name == event.stage)
                raise StageLost(stage, f"it reported: {event.header.get('error')}")
            elif event.kind == "bye" and event.stage in chain_names:
                stage = next(s for s in self.chain if s.name == event.stage)
                raise StageLost(stage, "it left the pipeline (stopped or shut down)")

    # -- recovery ------------------------------------------------------------------------------
    def _stage_stats(self) -> dict[str, dict]:
        return {stage.name: stage.stats for stage in self.chain}

    def _watch_speed(self, scheduler: Scheduler, inflight: dict[int, _InFlight], report: EventSink,
                     stats: RunStats) -> None:
        """Move layers off a stage that has slowed well below its measured normal (see broker.drift)."""
        if self.rebalance is None or not self._drift_watched:
            return
        slowed = self.drift.observe(self.clock(), self._stage_stats(), self.work)
        if not slowed:
            return
        started = self.clock()
        described = ", ".join(f"{name} {factor:.1f}x slower" for name, factor in slowed.items())
        chain = self.rebalance(slowed, report)
        if chain is None:
            report("slowed", f"{described} than its normal, but no other placement is faster: layers stay")
            self.drift.restart(self.clock(), self._stage_stats(), self.work)
            return
        event = self._resume_on(chain, scheduler, inflight, stats, started, ",".join(slowed), described)
        report("rebalanced", f"{described} than its normal: re-planned in {event['replan_s']:.2f} s: "
                             f"{', '.join(event['chain'])}; re-prefilling {event['reprefill_tokens']} tokens",
               duration_s=event["replan_s"])

    def _recover(self, scheduler: Scheduler, inflight: dict[int, _InFlight], lost: StageLost,
                 should_stop: Callable[[], bool], report: EventSink, stats: RunStats) -> bool:
        """Re-plan without the lost stage, then re-prefill every active sequence. False: stopping."""
        if self.recover is None:
            raise lost
        started = self.clock()
        report("stage_lost", str(lost), stage=lost.stage.name)
        inflight.clear()  # whatever was in flight is dropped; the re-prefill redoes it
        chain = self.recover(lost, should_stop, report)  # marks the stage lost, re-plans, reloads
        if chain is None:
            return False
        event = self._resume_on(chain, scheduler, inflight, stats, started, lost.stage.name, lost.reason)
        report("recovered", f"re-planned without {lost.stage.name} in {event['replan_s']:.2f} s: "
                            f"{', '.join(event['chain'])}; re-prefilling {event['reprefill_tokens']} tokens",
               stage=lost.stage.name, duration_s=event["replan_s"])
        return True

    def _resume_on(self, chain: list[StageInfo], scheduler: Scheduler, inflight: dict[int, _InFlight],
                   stats: RunStats, started: float, stage: str, reason: str) -> dict:
        """Go on with a freshly loaded chain: steps in flight belong to the old epoch (its stages drop
        them), every active sequence re-prefills, the drift watch takes a new baseline. Returns the
        re-plan's event, which the first new token and the end of the re-prefill complete."""
        inflight.clear()
        self.use_chain(chain)
        self.drift.restart(self.clock(), self._stage_stats(), self.work)
        tokens = scheduler.reset_caches()
        event = {"stage": stage, "reason": reason, "started": started, "replan_s": round(self.clock() - started, 3),
                 "reprefill_tokens": tokens, "chain": [f"{s.name} {s.layers}" for s in chain]}
        stats.recoveries.append(event)
        self._awaiting_first_token = self._replay_event = event
        return event


def _shared_cpu_host(chain: list[StageInfo]) -> bool:
    """All stages are CPU stages on one host (see DriftConfig.watch_shared_cpu_host)."""
    return len({stage.host for stage in chain}) == 1 and all(stage.device == "cpu" for stage in chain)
