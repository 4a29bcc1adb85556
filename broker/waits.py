"""Conversations with stages, written once and run two ways.

Measuring a stage is a conversation: send PROFILE, wait for its result, time its link, ask it to time its
links to the others, wait for each answer. Such a conversation is written as a generator that yields what
it waits for (a `Reply` from a stage, or a `Computed` result of work on another thread) and is sent back
what came. It then runs either

- blocking (`run_blocking`), where nothing else is going on: the broker starting, or re-planning after a
  loss, when no step can move anyway; or
- cooperatively (`Conversation`), one step at a time from the pipeline loop, so that steps keep flowing,
  lost stages are noticed within the liveness window, and a stage that joins mid-job is measured beside
  the chain's work instead of stopping it.

Either way a stage that leaves or falls silent while it is waited for ends the wait at once with
StageLost (within the liveness window, not after the reply's timeout): the caller drops that stage from
consideration and goes on with the others.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Generator, Generic, TypeVar

from layerbus.broker.control import ClusterError, ControlEvent, ControlPlane, StageInfo, StageLost, lost_reason

T = TypeVar("T")
# Kinds that answer a request of the broker's; one that arrives before it is waited for is kept for its wait.
ANSWERS = frozenset({"profile_result", "probe_echo", "link_probe_result", "link_admitted", "link_timed"})


def _any_header(header: dict) -> bool:
    return True


@dataclass(frozen=True)
class Reply:
    """Wait for a message of `kind` from `stage` whose header `accept`s, for at most `timeout_s`. Without
    `required`, a timeout sends None back; with it, it raises NoReply."""

    stage: StageInfo
    kind: str
    timeout_s: float
    accept: Callable[[dict], bool] = _any_header
    required: bool = True

    def matches(self, event: ControlEvent) -> bool:
        return event.kind == self.kind and event.stage == self.stage.name and self.accept(event.header)


@dataclass(frozen=True)
class Computed:
    """Wait for work running on another thread (a plan: pure, seconds long); its value is sent back, its
    exception raised into the conversation."""

    future: Future


Wait = Reply | Computed
Steps = Generator[Wait, Any, T]


class NoReply(ClusterError):
    """A stage did not answer in time, or answered that it could not: drop it, go on with the others."""

    def __init__(self, stage: StageInfo, reason: str):
        super().__init__(f"stage {stage.name}: {reason}")
        self.stage, self.reason = stage, reason


@dataclass(frozen=True)
class Liveness:
    """When a stage waited for counts as lost (control.lost_reason's window and stuck limit)."""

    window_s: float
    stuck_s: float


class Conversation(Generic[T]):
    """A conversation run a step at a time: `offer` it the control events as they come and call `tick`
    every loop; `done` once it has ended, with `value`, or `error` (StageLost, NoReply or whatever the
    conversation raised)."""

    def __init__(self, steps: Steps[T], liveness: Liveness, clock: Callable[[], float] = time.monotonic):
        self.steps, self.liveness, self.clock = steps, liveness, clock
        self.done = False
        self.value: T | None = None
        self.error: BaseException | None = None
        self.waiting: Wait | None = None
        self._deadline = 0.0
        self._backlog: list[ControlEvent] = []
        self._advance(lambda: next(self.steps))

    def offer(self, events: list[ControlEvent]) -> None:
        """Events the loop took from the control plane: an answer this conversation waits for moves it on."""
        for event in events:
            if self.done:
                return
            if isinstance(self.waiting, Reply) and self.waiting.matches(event):
                self._advance(lambda header=event.header: self.steps.send(header))
            elif event.kind in ANSWERS:
                self._backlog.append(event)

    def tick(self) -> None:
        """Check the wait: the work done on its thread, the stage lost, or the time up."""
        if self.done or self.waiting is None:
            return
        waiting = self.waiting
        if isinstance(waiting, Computed):
            if waiting.future.done():
                self._advance(lambda: self.steps.send(waiting.future.result()))
            return
        reason = lost_reason(waiting.stage, self.clock(), self.liveness.window_s, self.liveness.stuck_s)
        if reason is not None:
            self._advance(lambda: self.steps.throw(StageLost(waiting.stage, reason)))
        elif self.clock() > self._deadline:
            if waiting.required:
                error = NoReply(waiting.stage, f"sent no {waiting.kind} within {waiting.timeout_s:.0f} s")
                self._advance(lambda: self.steps.throw(error))
            else:
                self._advance(lambda: self.steps.send(None))

    def cancel(self) -> None:
        """Abandon it (the chain broke meanwhile: the re-plan starts over)."""
        if not self.done:
            self.steps.close()
            self.done, self.error = True, ClusterError("cancelled")

    def _advance(self, resume: Callable[[], Wait]) -> None:
        while True:
            try:
                wait = resume()
            except StopIteration as stop:
                self.done, self.value, self.waiting = True, stop.value, None
                return
            except Exception as error:  # noqa: BLE001 - the conversation's outcome, for its owner
                self.done, self.error, self.waiting = True, error, None
                return
            self.waiting = wait
            if isinstance(wait, Reply):
                self._deadline = self.clock() + wait.timeout_s
                kept = next((event for event in self._backlog if wait.matches(event)), None)
                if kept is not None:  # it came before it was waited for
                    self._backlog.remove(kept)
                    resume = lambda header=kept.header: self.steps.send(header)  # noqa: E731
                    continue
            return


def run_blocking(control: ControlPlane, steps: Steps[T], liveness: Liveness,
                 watch: Callable[[], None] = lambda: None, poll_ms: int = 50) -> T:
    """Run a conversation to its end here, polling the control plane; `watch` is called every loop (to
    notice other stages lost meanwhile: it raises StageLost for one). Returns its value or raises."""
    conversation = Conversation(steps, liveness, control.clock)
    while not conversation.done:
        conversation.offer(control.poll(poll_ms))
        conversation.tick()
        if not conversation.done:
            try:
                watch()
            except BaseException:
                conversation.cancel()
                raise
    if conversation.error is not None:
        raise conversation.error
    return conversation.value
