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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch
import zmq

from layerbus.planner.chain import Placement
from layerbus.broker.control import ControlPlane, StageInfo, StageLost
from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.planner.drift import DriftConfig, DriftWatch, Work
from layerbus.broker.prefix_cache import PrefixIndex
from layerbus.planner.prefix_budget import prefix_positions
from layerbus.broker.run_state import (
    BrokerCounts,
    EventSink,
    InFlight,
    RequestSource,
    ResultSink,
    RunState,
    RunStats,
)
from layerbus.planner.batching import BatchingConfig
from layerbus.broker.scheduler import Scheduler, StepPlan
from layerbus.broker.speculation import SpeculationStats
from layerbus.broker.step_rows import step_rows
from layerbus.broker.trace_file import BrokerTrace
from layerbus.broker.run_replans import Replan, RunReplans
from layerbus.wire import protocol
from layerbus.wire.curve import secure_client
from layerbus.wire.frames import DEFAULT_MAX_MESSAGE_BYTES, WireError, decode, encode
from layerbus.wire.constraint import Constraint

if TYPE_CHECKING:
    from layerbus.broker.grammar import TokenGrammar
    from layerbus.broker.replanning import Replanner
from layerbus.wire.trace_events import APPLY, PLAN, RESULT, TRANSMIT

log = logging.getLogger("layerbus.broker")


MAX_RESEND_BACKOFF = 8  # attempt k waits step_timeout_s * 2**k, at most this many times step_timeout_s


def resend_after_s(step_timeout_s: float, attempt: int) -> float:
    """How long attempt `attempt` (0 first) of a step may stay out before it is sent again. Doubling
    per attempt: on a link slower than the timeout assumed, each resend adds the step's bytes to the
    same queue, so resending at a fixed period would keep the link full of copies and nothing would
    come back; backing off lets the queue drain. A message lost to a dead peer is still resent soon."""
    return step_timeout_s * min(2 ** attempt, MAX_RESEND_BACKOFF)


@dataclass(frozen=True)
class PipelineConfig:
    """Timing of the data-plane loop."""

    heartbeat_interval_s: float = 0.5  # broker -> stage heartbeats (stages send theirs as often)
    liveness_window_s: float = 5.0  # a stage silent this long (no heartbeat, no message) is lost
    stuck_step_s: float = 300.0  # a stage whose heartbeats say one step has run this long is lost
    step_timeout_s: float = 60.0  # a step not back after this long is resent (next attempt; doubling after)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger results are rejected
    drift: DriftConfig = field(default_factory=DriftConfig)  # when a slowed stage has layers moved off it

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.liveness_window_s:
            raise ValueError(f"need 0 < heartbeat interval ({self.heartbeat_interval_s} s) < liveness window "
                             f"({self.liveness_window_s} s): a live stage must get several heartbeats in per window")
        if self.step_timeout_s <= 0 or self.stuck_step_s <= 0:
            raise ValueError(f"step_timeout_s and stuck_step_s must be > 0, got {self.step_timeout_s}, "
                             f"{self.stuck_step_s}")


class Pipeline(RunReplans):
    def __init__(self, context: zmq.Context, control: ControlPlane, placement: Callable[[], Placement],
                 results_socket: zmq.Socket, batching: BatchingConfig, eos_ids: set[int],
                 new_detokenizer: Callable[[], IncrementalDetokenizer] | None = None,
                 config: PipelineConfig = PipelineConfig(), clock: Callable[[], float] = time.monotonic,
                 replanner: Replanner | None = None, tracer: BrokerTrace | None = None,
                 counts: BrokerCounts | None = None,
                 new_grammar: Callable[[Constraint], TokenGrammar] | None = None):
        self.control, self.config, self.clock = control, config, clock
        self.new_grammar = new_grammar  # a constrained request's grammar state (broker/grammar.py, loaded lazily)
        self.counts = counts if counts is not None else BrokerCounts()  # the owner's, read by its metrics
        self.placement = placement  # the owner's placement in use (it swaps it whole on a re-plan)
        self.batching, self.eos_ids, self.new_detokenizer = batching, eos_ids, new_detokenizer
        self._prefixes: PrefixIndex | None = None  # the stages' prefix entries, kept from run to run
        self._prefixes_epoch = -1  # the placement epoch they were saved in (a re-plan empties every arena)
        # Re-plans (a lost stage, a slowed one, one that joined); None: a lost stage ends the run with
        # ClusterError, a slowed one keeps its layers, one that registers mid-run waits as a spare.
        self.replanner = replanner
        self._replan: Replan | None = None  # the re-plan running beside the steps, if any
        self.drift = DriftWatch(config.drift, replanner.expected_busy_s if replanner is not None else None)
        self.work = Work()  # what has been sent down the chain, for the drift watch
        self.results = results_socket
        self.context = context
        # --trace: spans of this loop's work, and the stages' last records at the end of each run. None:
        # nothing is recorded (one `is not None` check where a span would begin or end).
        self.tracer = tracer
        self.push: zmq.Socket | None = None
        self.first_stage: tuple[str, str | None] | None = None  # (data address, CURVE key) steps go to
        self._followed: Placement | None = None
        self._drift_watched = False
        self._follow_placement()
        self.next_step = 0

    @property
    def chain(self) -> list[StageInfo]:
        """The stages of the placement in use, in chain order (the owner's: the processes that loaded it)."""
        if self.replanner is not None:
            return self.replanner.keeper.chain
        return [self.control.stage(name) for name in self.placement().stages]

    def _follow_placement(self) -> None:
        """Send to the owner's placement in use (after a re-plan, its first stage may have changed)."""
        placement = self.placement()
        if placement is self._followed:
            return
        self._followed, chain = placement, self.chain
        # Decided once per placement, not per loop: CPU stages sharing one host are not watched for drift.
        self._drift_watched = self.config.drift.watch_shared_cpu_host or not _shared_cpu_host(chain)
        if (chain[0].data_address, chain[0].public_key) != self.first_stage:
            self._connect_first(chain[0])

    def _connect_first(self, stage: StageInfo) -> None:
        """Steps go to this stage from now on: a CURVE client of its data port on a secured cluster."""
        if self.push is not None:
            self.push.close(linger=0)
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        if self.control.keys is not None:
            secure_client(self.push, self.control.keys.keypair, stage.public_key.encode())
        self.push.connect(stage.data_address)
        self.first_stage = (stage.data_address, stage.public_key)

    def close(self) -> None:
        self.push.close(linger=0)

    def run(self, source: RequestSource, sink: ResultSink, should_stop: Callable[[], bool] = lambda: False,
            events: EventSink | None = None) -> RunStats:
        """Serve requests from `source` until it is exhausted and nothing is in flight. `events`
        hears of every lost stage, wait and recovery (the job runner records them in the store)."""
        self._follow_placement()  # the owner may have re-planned between runs (keep_alive)
        run = RunState(Scheduler(self.batching, len(self.placement().stages), self.eos_ids, self.new_detokenizer,
                                 new_grammar=self.new_grammar, prefix_cache=self._prefix_index()),
                       source, sink, should_stop, events)
        started, cpu_started = self.clock(), time.process_time()
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.control.wake, zmq.POLLIN)
        self.drift.restart(self.clock(), self._stage_stats(), self.work)
        while True:
            stopping = should_stop()
            if not stopping:
                run.top_up(self.clock)
                # Again while a pass sent anything: planning one micro-batch may hand sequences at a job's
                # tail to an idle one that this pass had already found empty (Scheduler._balance_tail).
                while any([self._send(run, mb) for mb in range(run.scheduler.num_micro_batches)
                           if mb not in run.inflight]):
                    pass
            if not run.inflight and (stopping or (run.scheduler.idle and source.exhausted)):
                break
            try:
                self._serve_once(run, poller)
            except StageLost as lost:
                self._abandon_replan()
                if not self._recover(run, lost):
                    break  # asked to stop while waiting for stages: the caller hands the items back
        self._abandon_replan()
        run.stats.wall_s = self.clock() - started
        run.stats.broker_cpu_s = time.process_time() - cpu_started
        if self.tracer is not None:  # the stages' last records, with stats that count the same steps
            self.tracer.collect(self.control, self.chain)
        run.stats.stage_stats = {s.name: dict(s.stats) for s in self.chain}
        self._report_prefix_cache(run)
        self._report_speculation(run)
        return run.stats

    def _prefix_index(self) -> PrefixIndex | None:
        """The prefix cache's bookkeeping for a run. It outlives the run, as the stages' entries do: the next
        job of this broker restores what this one saved. A new epoch means new arenas, so new bookkeeping."""
        batching = self.batching.resolved(len(self.placement().stages))
        positions = prefix_positions(batching.prefix_cache, batching.num_slots, batching.max_context)
        if not positions:
            return None
        if self._prefixes is None or self._prefixes_epoch != self.control.epoch:
            config = replace(batching.prefix_cache, budget_tokens=positions)  # as the plan counted it
            self._prefixes, self._prefixes_epoch = PrefixIndex(config), self.control.epoch
        self._prefixes.start_run()
        return self._prefixes

    def _report_prefix_cache(self, run: RunState) -> None:
        """The run's prefix-cache figures: in its stats, the log and the job's events (status JOB shows them)."""
        index = run.scheduler.prefix_cache
        if index is None or not index.stats.prompts:
            return
        figures = run.stats.prefix_cache = index.stats.to_json()
        message = (f"prefix cache: {figures['restored_tokens']} of {figures['prompt_tokens']} prompt tokens copied "
                   f"instead of computed ({100 * figures['hit_rate']:.1f}%; {figures['hits']} of {figures['prompts']} "
                   f"prompts started from a saved prefix; prefixes saved {figures['saved_entries']}, "
                   f"evicted {figures['evicted_entries']})")
        log.info("%s", message)
        if run.events is not None:
            run.events("prefix_cache", message, **figures)

    def _report_speculation(self, run: RunState) -> None:
        """The run's drafting figures: in its stats, the log and the job's events (status JOB shows them)."""
        speculation = run.scheduler.speculation
        if not speculation.enabled or not speculation.stats.trips:
            return
        figures = run.stats.speculation = dict(speculation.stats.to_json(), mode=speculation.config.mode)
        message = (f"speculation ({figures['mode']}): {figures['accepted']} of {figures['proposed']} draft tokens "
                   f"accepted ({100 * figures['acceptance']:.1f}%), {figures['tokens_per_trip']:.2f} tokens per trip "
                   f"over {figures['trips']} decode trips")
        log.info("%s", message)
        if run.events is not None:
            run.events("speculation", message, **figures)

    def _serve_once(self, run: RunState, poller: zmq.Poller) -> None:
        """Take in what arrived, keep heartbeats going, resend what is overdue, and raise StageLost
        for a stage of the chain that can serve no more (control.lost_reason decides)."""
        if self.results in dict(poller.poll(50)):
            self._receive_results(run)
        events = self.control.poll(0)  # what the control thread took in (it answered the stages already)
        self._handle_control(run, events)
        if self._replan is not None:
            self._replan.conversation.offer(events)
            self._replan.conversation.tick()
        if self.control.refusals:  # peers refused in a handshake, here or at a stage's data port
            for message in self.control.take_refusals():
                run.report("refused", message)
        self._resend_overdue(run)
        self.control.check_stages(self.chain, self.config.liveness_window_s, self.config.stuck_step_s)
        if self.replanner is not None:
            self.replanner.check_spares(self.config.liveness_window_s, self.config.stuck_step_s, run.report)
        self._finish_replan(run)
        self._watch_speed(run)
        self._watch_joins(run)

    # -- sending -------------------------------------------------------------------------------
    def _send(self, run: RunState, mb: int) -> bool:
        """Plan and send the micro-batch's next step; False when it has nothing to send."""
        tracer = self.tracer
        began = tracer.now() if tracer is not None else 0.0
        plan = run.scheduler.plan_step(mb, self.clock())
        if plan is None:
            return False
        step = self.next_step
        self.next_step += 1
        if tracer is not None:
            tracer.span("plan", PLAN, began, tracer.now(), mb=mb, step=step, rows=len(plan.rows),
                        tokens=sum(len(row.tokens) for row in plan.rows))
        self._transmit(run.scheduler, plan, step, 0)
        run.inflight[mb] = InFlight(plan, step, 0, self.clock())
        return True

    def _transmit(self, scheduler: Scheduler, plan: StepPlan, step: int, attempt: int) -> None:
        began = self.tracer.now() if self.tracer is not None else 0.0
        rows, tokens = step_rows(scheduler, plan)
        prefill = sum(len(row.tokens) for row in plan.rows if len(row.tokens) > 1)
        self.work = Work(self.work.steps + 1, self.work.decode_rows + sum(len(row.tokens) == 1 for row in plan.rows),
                         self.work.prefill_tokens + prefill, self.work.emit_rows + sum(row.emit for row in plan.rows))
        header = {"kind": protocol.STEP, "mb": plan.micro_batch, "step": step, "attempt": attempt,
                  "epoch": self.control.epoch, "rows": protocol.rows_to_json(rows), "release": plan.released}
        prefix = protocol.prefix_ops_to_json(
            [(row.slot, *row.restore) for row in plan.rows if row.restore is not None],
            [(row.slot, *row.save) for row in plan.rows if row.save is not None], plan.dropped_prefixes)
        if prefix:
            header["prefix"] = prefix
        if plan.window is not None:
            header["window"] = list(plan.window)
        self.push.send_multipart(encode(header, {"tokens": torch.tensor(tokens, dtype=torch.int64)}), copy=False)
        if self.tracer is not None:
            self.tracer.span("transmit", TRANSMIT, began, self.tracer.now(), mb=plan.micro_batch, step=step,
                             attempt=attempt, rows=len(rows), tokens=len(tokens))

    def _resend(self, run: RunState, current: InFlight) -> None:
        """Send a step again, same rows, next attempt: replaying a step rewrites the same cache positions."""
        current.attempt += 1
        current.sent_at = self.clock()
        run.stats.resent += 1
        self.counts.resent_steps += 1
        self._transmit(run.scheduler, current.plan, current.step, current.attempt)

    def _resend_overdue(self, run: RunState) -> None:
        now = self.clock()
        for mb, current in run.inflight.items():
            if now - current.sent_at > resend_after_s(self.config.step_timeout_s, current.attempt):
                log.warning("step %d of micro-batch %d not back after %.0f s: sending attempt %d (the next after "
                            "%.0f s; a link this slow needs a longer step timeout)", current.step, mb,
                            now - current.sent_at, current.attempt + 1,
                            resend_after_s(self.config.step_timeout_s, current.attempt + 1))
                self._resend(run, current)

    # -- receiving -----------------------------------------------------------------------------
    def _receive_results(self, run: RunState) -> None:
        tracer = self.tracer
        while self.results.poll(0):
            began = tracer.now() if tracer is not None else 0.0
            header = self._read_result()
            if header is None:
                continue
            if tracer is not None:
                read = tracer.now()
                tracer.span("result", RESULT, began, read, mb=header["mb"], step=header["step"],
                            attempt=header["attempt"], tokens=len(header["tokens"]))
            current = run.inflight.get(header["mb"])
            if (current is None or header["epoch"] != self.control.epoch or current.step != header["step"]
                    or current.attempt != header["attempt"]):
                log.info("discarding a late or duplicate result: micro-batch %s step %s attempt %s epoch %s",
                         header["mb"], header["step"], header["attempt"], header["epoch"])
                run.stats.discarded += 1
                continue
            del run.inflight[header["mb"]]
            run.stats.steps += 1
            # [slot, token, logprob] or, for a row that asked for top_logprobs, [slot, token, logprob, [[id, lp], ...]]
            tokens = {entry[0]: tuple(entry[1:]) for entry in header["tokens"]}
            scores = {entry[0]: (entry[1], entry[2]) for entry in header.get("scores", [])}
            # [slot, [[token, logprob(, top)], ...]]: the drafts accepted before the row's token (wire/sampling.py)
            accepted = {entry[0]: entry[1] for entry in header.get("accepted", [])
                        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)}
            if current.attempt == 0:  # a resent step's time says nothing of the chain's
                run.scheduler.speculation.trip(sum(len(row.tokens) for row in current.plan.rows),
                                               self.clock() - current.sent_at)
            drafting = run.scheduler.speculation.stats
            before = (drafting.proposed, drafting.accepted, drafting.trips, drafting.tokens)
            run.deliver(run.scheduler.apply_result(current.plan, tokens, self.clock(), scores, accepted))
            self._count_drafts(before, drafting)
            if tokens:
                emitted = ((run.stats.progress[-1][1] if run.stats.progress else 0) + len(tokens)
                           + sum(len(taken) for taken in accepted.values()))
                run.stats.progress.append((self.clock(), emitted))
            self._note_replan_progress(run, bool(tokens))
            if tracer is not None:
                tracer.span("apply", APPLY, read, tracer.now(), mb=header["mb"], step=header["step"],
                            tokens=len(tokens), scores=len(scores))
            self._send(run, header["mb"])

    def _count_drafts(self, before: tuple[int, int, int, int], after: SpeculationStats) -> None:
        counts = self.counts
        counts.drafts_proposed += after.proposed - before[0]
        counts.drafts_accepted += after.accepted - before[1]
        counts.decode_trips += after.trips - before[2]
        counts.decode_tokens += after.tokens - before[3]

    def _read_result(self) -> dict | None:
        """The next result's header, or None for a malformed one (logged, dropped)."""
        frames = self.results.recv_multipart(copy=False)
        try:
            header = decode(frames, self.config.max_message_bytes).header
            protocol.require_fields(header, "result", {"mb": int, "step": int, "attempt": int, "epoch": int,
                                                       "tokens": list})
        except WireError as error:
            log.error("rejected a result message: %s", error)
            return None
        return header

    def _stage_stats(self) -> dict[str, dict]:
        return {stage.name: stage.stats for stage in self.chain}

    def _handle_control(self, run: RunState, events: list) -> None:
        """Failures of one step. A stage that left or failed as a whole is the control plane's to mark
        (its state); `control.check_stages` then raises StageLost for it."""
        for event in events:
            if event.kind != "failure" or not isinstance(event.header.get("mb"), int):
                continue
            current = run.inflight.get(event.header["mb"])
            if (current is None or current.step != event.header.get("step")
                    or event.header.get("epoch") != self.control.epoch
                    or event.header.get("attempt", current.attempt) != current.attempt):
                continue  # about a step already settled
            if event.header.get("cause") == "send":
                self._resend(run, current)  # the next hop is the problem, not the items
                continue
            self.counts.failed_steps += 1
            error = f"stage {event.stage}: {event.header.get('error')}"
            if current.plan.window is not None:
                self._replay_every_layer(run, error)
                continue
            del run.inflight[event.header["mb"]]
            run.deliver(run.scheduler.fail_step(current.plan, error, self.clock()))

    # -- re-plans ------------------------------------------------------------------------------
def _shared_cpu_host(chain: list[StageInfo]) -> bool:
    """All stages are CPU stages on one host (see DriftConfig.watch_shared_cpu_host)."""
    return len({stage.host for stage in chain}) == 1 and all(stage.device == "cpu" for stage in chain)
