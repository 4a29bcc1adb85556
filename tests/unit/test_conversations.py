"""Conversations with stages (broker/waits.py), run a step at a time as the pipeline loop runs them and to the end
as the broker does while starting: answers move them on (in any order), a stage that leaves or falls silent
ends the wait at once with StageLost, a timeout ends it with NoReply (or None where an answer is optional),
and work on another thread is waited for without blocking the loop."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from layerbus.broker.control import ControlEvent, StageInfo, StageLost, StageState
from layerbus.broker.waits import Computed, Conversation, Liveness, NoReply, Reply, run_blocking

LIVENESS = Liveness(window_s=5.0, stuck_s=300.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stage(name: str, clock: Clock) -> StageInfo:
    return StageInfo(name.encode(), name, "cpu", "float32", 1, None, "tcp://127.0.0.1:1", "box", 1, clock.now)


def answer(kind: str, name: str, **header) -> ControlEvent:
    return ControlEvent(kind, name, header)


def ask_both(a: StageInfo, b: StageInfo):
    first = yield Reply(a, "profile_result", 10.0)
    second = yield Reply(b, "profile_result", 10.0)
    return first["value"] + second["value"]


def test_answers_move_it_on_in_the_order_they_come_or_not():
    clock = Clock()
    a, b = stage("a", clock), stage("b", clock)
    talk = Conversation(ask_both(a, b), LIVENESS, clock)
    talk.offer([answer("profile_result", "b", value=2), answer("heartbeat", "a")])  # b's answer first: kept
    assert not talk.done and talk.waiting.stage is a
    talk.offer([answer("profile_result", "a", value=1)])
    assert talk.done and talk.value == 3 and talk.error is None


def test_an_answer_from_another_stage_or_of_another_kind_does_not_count():
    clock = Clock()
    a, b = stage("a", clock), stage("b", clock)
    talk = Conversation(ask_both(a, b), LIVENESS, clock)
    talk.offer([answer("profile_result", "c", value=9), answer("link_probe_result", "a")])
    assert not talk.done and talk.waiting.stage is a


@pytest.mark.parametrize("how, reason", [
    ("silent", "silent for 6.0 s"),
    ("gone", "it left"),
    ("failed", "it reported"),
])
def test_a_stage_lost_while_waited_for_ends_the_wait_at_once(how, reason):
    clock = Clock()
    a, b = stage("a", clock), stage("b", clock)
    talk = Conversation(ask_both(a, b), LIVENESS, clock)
    if how == "silent":
        clock.now += 6.0  # past the liveness window, before the reply's 10 s timeout
    elif how == "gone":
        a.state = StageState.GONE
    else:
        a.state, a.error = StageState.FAILED, "broken device"
    talk.tick()
    assert talk.done and isinstance(talk.error, StageLost) and talk.error.stage is a
    assert reason in str(talk.error)


def test_a_stage_that_does_not_answer_in_time_ends_it_with_no_reply():
    clock = Clock()
    a, b = stage("a", clock), stage("b", clock)
    talk = Conversation(ask_both(a, b), Liveness(window_s=60.0, stuck_s=300.0), clock)
    clock.now += 11.0
    a.last_seen = b.last_seen = clock.now  # alive, heartbeating, but not answering
    talk.tick()
    assert talk.done and isinstance(talk.error, NoReply) and talk.error.stage is a
    assert "sent no profile_result within 10 s" in str(talk.error)


def test_an_optional_answer_that_does_not_come_is_none():
    clock = Clock()
    a = stage("a", clock)

    def optional():
        got = yield Reply(a, "link_probe_result", 1.0, required=False)
        return got

    talk = Conversation(optional(), LIVENESS, clock)
    clock.now += 2.0
    talk.tick()
    assert talk.done and talk.value is None and talk.error is None


def test_work_on_another_thread_is_waited_for_without_blocking():
    clock = Clock()
    future: Future = Future()

    def plan():
        value = yield Computed(future)
        return value * 2

    talk = Conversation(plan(), LIVENESS, clock)
    talk.tick()
    assert not talk.done  # the loop goes on meanwhile
    future.set_result(21)
    talk.tick()
    assert talk.done and talk.value == 42


def test_cancelled_it_ends_and_says_so():
    clock = Clock()
    a, b = stage("a", clock), stage("b", clock)
    talk = Conversation(ask_both(a, b), LIVENESS, clock)
    talk.cancel()
    assert talk.done and talk.error is not None


class ScriptedControl:
    """Answers each poll with the next batch of events; its clock moves a second a poll."""

    def __init__(self, batches: list[list[ControlEvent]], clock: Clock):
        self.batches, self.clock = batches, clock

    def poll(self, timeout_ms: int) -> list[ControlEvent]:
        self.clock.now += 1.0
        return self.batches.pop(0) if self.batches else []


def test_run_blocking_returns_the_value_and_watch_can_stop_it():
    clock = Clock()
    a, b = stage("a", clock), stage("b", clock)
    control = ScriptedControl([[answer("profile_result", "a", value=1)], [answer("profile_result", "b", value=4)]],
                              clock)
    a.last_seen = b.last_seen = 1e9  # heard from "now" throughout
    assert run_blocking(control, ask_both(a, b), LIVENESS) == 5

    c = stage("c", clock)
    c.last_seen = 1e9

    def other_lost() -> None:
        raise StageLost(c, "killed meanwhile")

    with pytest.raises(StageLost, match="killed meanwhile"):
        run_blocking(ScriptedControl([], clock), ask_both(a, b), LIVENESS, watch=other_lost)
