"""One run of the pipeline as one value: where requests come from and where results go, the
scheduler, the steps in flight, the stats and the events sink. The pipeline's methods take this
one object instead of five parameters."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.broker.scheduler import Scheduler, StepPlan

log = logging.getLogger("layerbus.broker")

# report(kind, message, **fields): a fault-handling event (stage_lost, waiting, recovered, ...).
EventSink = Callable[..., None]


class RequestSource(Protocol):
    """Where requests come from (a list, a job store). `fetch` never blocks for long. `ahead` of the
    `limit` are for the broker's waiting line rather than its free slots: a source shared with other
    brokers may hold those back where another broker could start them sooner (jobs/claim_share.py)."""

    def fetch(self, limit: int, ahead: int = 0) -> list[GenerationRequest]: ...

    @property
    def exhausted(self) -> bool: ...


class ResultSink(Protocol):
    def deliver(self, results: list[GenerationResult]) -> None: ...


class ListSource:
    """A fixed list of requests (tests, benchmarks, `generate`)."""

    def __init__(self, requests: list[GenerationRequest]):
        self.pending = list(reversed(requests))

    def fetch(self, limit: int, ahead: int = 0) -> list[GenerationRequest]:
        taken = []
        while self.pending and len(taken) < limit:
            taken.append(self.pending.pop())
        return taken

    @property
    def exhausted(self) -> bool:
        return not self.pending


class RecordingSource:
    """A source that remembers the ids of the requests it handed out, in order."""

    def __init__(self, source: RequestSource):
        self.source = source
        self.request_ids: list[str] = []

    def fetch(self, limit: int, ahead: int = 0) -> list[GenerationRequest]:
        requests = self.source.fetch(limit, ahead=ahead)
        self.request_ids.extend(r.request_id for r in requests)
        return requests

    @property
    def exhausted(self) -> bool:
        return self.source.exhausted

    def __getattr__(self, name: str):  # whatever else the wrapped source offers
        return getattr(self.source, name)


class RecordingSink:
    """A sink that remembers how many tokens each result generated (to price the run afterwards)."""

    def __init__(self, sink: ResultSink):
        self.sink = sink
        self.generated: dict[str, int] = {}

    def deliver(self, results: list[GenerationResult]) -> None:
        for result in results:
            self.generated[result.request_id] = len(result.token_ids)
        self.sink.deliver(results)

    def output_lengths(self, request_ids: list[str]) -> list[int] | None:
        """Tokens generated per request, in `request_ids` order; None unless every one has a result."""
        if not request_ids or any(rid not in self.generated for rid in request_ids):
            return None
        return [self.generated[rid] for rid in request_ids]

    def __getattr__(self, name: str):
        return getattr(self.sink, name)


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
    recoveries: list[dict] = field(default_factory=list)  # one event per re-plan (see Pipeline._resume_on)
    # (clock, new tokens so far) after every step that emitted tokens: throughput over any window.
    progress: list[tuple[float, int]] = field(default_factory=list)
    source_exhausted_at: float | None = None  # clock when the last request was taken from the source
    prefix_cache: dict | None = None  # broker.prefix_cache.PrefixStats of the run (None: the cache was off)
    speculation: dict | None = None  # broker.speculation.SpeculationStats of the run (None: speculation was off)


@dataclass
class BrokerCounts:
    """What the broker has been through since it started, over every run (its metrics' counters): only grows."""

    stages_lost: int = 0  # stages declared lost (silent, stuck, gone or failed), while starting or serving
    replans_lost: int = 0  # placements made again without a lost stage
    replans_slowed: int = 0  # placements made again to move layers off a slowed stage
    replans_joined: int = 0  # placements made again to put stages that registered mid-job to work
    failed_steps: int = 0  # steps a stage reported failed (their items are retried alone, or fail)
    resent_steps: int = 0  # steps sent again: overdue, or the next hop could not be reached
    drafts_proposed: int = 0  # draft tokens sent for the last stage to verify (broker/speculation.py)
    drafts_accepted: int = 0  # of which it accepted
    decode_trips: int = 0  # decode rows sent down the chain
    decode_tokens: int = 0  # tokens those trips yielded (more than the trips where drafts were accepted)


@dataclass
class InFlight:
    """A step sent down the chain and not back yet."""

    plan: StepPlan
    step: int  # the pipeline's step number (stamped on the message)
    attempt: int  # 0, then one more per resend
    sent_at: float  # clock of the last send


@dataclass
class RunState:
    """Everything one `Pipeline.run` moves along."""

    scheduler: Scheduler
    source: RequestSource
    sink: ResultSink
    should_stop: Callable[[], bool]
    events: EventSink | None = None  # hears of every lost stage, wait and recovery (the job runner stores them)
    inflight: dict[int, InFlight] = field(default_factory=dict)  # micro-batch -> its step in flight
    stats: RunStats = field(default_factory=RunStats)
    awaiting_first_token: dict | None = None  # the re-plan event waiting for its first new token
    replay_event: dict | None = None  # the re-plan event waiting for its re-prefill to end

    def report(self, kind: str, message: str, **fields) -> None:
        log.warning("%s: %s", kind, message)
        if self.events is not None:
            self.events(kind, message, **fields)

    def deliver(self, finished: list[GenerationResult]) -> None:
        if not finished:
            return
        for result in finished:
            self.stats.finished += 1
            self.stats.errors += result.error is not None
            self.stats.new_tokens += len(result.token_ids)
            self.stats.prompt_tokens += result.prompt_tokens
        self.sink.deliver(finished)

    def top_up(self, clock: Callable[[], float]) -> None:
        """Take requests from the source while slots are free, plus half the slots waiting in line (so
        that a freed slot never waits for the store); the line's part is `ahead`."""
        scheduler = self.scheduler
        free, waiting = scheduler.free_slots(), len(scheduler.waiting)
        wanted = free + scheduler.config.num_slots // 2 - waiting
        if wanted <= 0 or self.source.exhausted:
            return
        ahead = wanted - max(0, free - waiting)
        now = clock()
        requests = self.source.fetch(wanted, ahead=ahead)
        self.deliver([r for r in (scheduler.submit(req, now) for req in requests) if r])
        if self.source.exhausted and self.stats.source_exhausted_at is None:
            self.stats.source_exhausted_at = clock()
