"""A running pipeline's re-plans: a slowed stage's and a joining stage's, computed beside the steps (their
conversations, broker/waits.py), and a lost stage's, which stops the chain; then going on with the new
placement, each sequence replaying what the stages did not keep. Part of Pipeline (broker/pipeline.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from layerbus.broker.control import StageInfo, StageLost
from layerbus.broker.replay_window import StageCaches, replay_window
from layerbus.broker.run_state import RunState
from layerbus.broker.waits import Conversation, Liveness
from layerbus.planner.chain import Placement
from layerbus.wire.spans import LayerRange

if TYPE_CHECKING:
    from layerbus.broker.replanning import Replanner

log = logging.getLogger("layerbus.broker")


@dataclass
class Replan:
    """A re-plan the loop runs beside its steps (a stage slowed, or joined): its conversation, and what for."""

    kind: str  # "rebalanced" or "grown"
    conversation: Conversation
    started: float
    stages: str  # the stages it is about, comma-separated
    described: str  # "stage-1 2.1x slower", or the stages that joined
    joined: list[StageInfo] = field(default_factory=list)


class RunReplans:
    """The re-plan half of Pipeline: it reads the pipeline's control plane, placement, drift watch and clock."""

    replanner: Replanner | None
    _replan: Replan | None

    def _note_replan_progress(self, run: RunState, emitted: bool) -> None:
        """Complete the last re-plan's event: when every cache is rebuilt, when the first new token came."""
        if run.replay_event is not None and not run.scheduler.replaying:
            event, run.replay_event = run.replay_event, None
            # A new baseline for the drift watch: a replay's steps run only some of each stage's layers, for
            # the price of them all, and against that every stage would look slowed once it ended.
            self.drift.restart(self.clock(), self._stage_stats(), self.work)
            event["reprefill_s"] = round(self.clock() - event["started"], 3)
            run.report("reprefilled", f"every sequence's cache rebuilt ({event['reprefill_tokens']} tokens) "
                                      f"{event['reprefill_s']:.2f} s after the re-plan began",
                       duration_s=event["reprefill_s"])
        if emitted and run.awaiting_first_token is not None:
            event, run.awaiting_first_token = run.awaiting_first_token, None
            event["first_token_s"] = round(self.clock() - event["started"], 3)
            run.report("first_token", f"first new token {event['first_token_s']:.2f} s after the re-plan began "
                                      f"({event['stage']})", stage=event["stage"], duration_s=event["first_token_s"])

    def _watch_speed(self, run: RunState) -> None:
        """Move layers off a stage that has slowed well below its measured normal (see planner.drift): the
        plan with it slowed is computed beside the steps, and loaded if it is enough faster."""
        if self.replanner is None or not self._drift_watched or self._replan is not None:
            return
        slowed = self.drift.observe(self.clock(), self._stage_stats(), self.work)
        if not slowed:
            return
        described = ", ".join(f"{name} {factor:.1f}x slower" for name, factor in slowed.items())
        steps = self.replanner.rebalance_steps(slowed, run.report)
        self._replan = Replan("rebalanced", Conversation(steps, self._liveness(), self.clock), self.clock(),
                              ",".join(slowed), described)

    def _watch_joins(self, run: RunState) -> None:
        """Stages that registered since the placement was made are measured beside the steps (profiled, their
        links timed) and join the chain when the owner's plan with them is faster; every active sequence
        then replays what the stages did not keep."""
        if self.replanner is None or self._replan is not None:
            return
        joined = self.replanner.keeper.joined_stages()
        if not joined:
            return
        steps = self.replanner.grow_steps(joined, run.report)
        names = ", ".join(stage.name for stage in joined)
        self._replan = Replan("grown", Conversation(steps, self._liveness(), self.clock), self.clock(), names, names,
                              joined)

    def _liveness(self) -> Liveness:
        return self.replanner.keeper.config.liveness

    def _finish_replan(self, run: RunState) -> None:
        """Act on a re-plan that has ended: load the placement it chose, or say why the chain stays as it is.
        A stage of the chain lost meanwhile raises StageLost (the loop recovers); a newcomer that could not be
        measured is left out, and the job goes on."""
        replan = self._replan
        if replan is None or not replan.conversation.done:
            return
        self._replan = None
        conversation = replan.conversation
        if conversation.error is not None:
            stage = getattr(conversation.error, "stage", None)
            if isinstance(conversation.error, StageLost) and stage is not None and stage.name in self.placement().stages:
                raise conversation.error
            if replan.kind == "grown":
                self.replanner.left_out(replan.joined, conversation.error, run.report)
            else:
                log.warning("re-planning around %s failed: %s", replan.described, conversation.error)
                self.drift.restart(self.clock(), self._stage_stats(), self.work)
            return
        if conversation.value is None:
            if replan.kind == "rebalanced":
                run.report("slowed", f"{replan.described} than its normal, but no other placement is faster: "
                                     "layers stay")
                self.drift.restart(self.clock(), self._stage_stats(), self.work)
            return
        before = self.placement()
        self.replanner.load(conversation.value, replan.joined[0] if replan.joined else None)
        if replan.kind == "rebalanced":
            event = self._resume_on(run, replan.started, replan.stages, replan.described)
            run.report("rebalanced", f"{replan.described} than its normal: re-planned in {event['replan_s']:.2f} s: "
                                     f"{event['chain']}; {_replay_text(event)}",
                       duration_s=event["replan_s"], replay_layers=event["replay_layers"])
            return
        joined = [name for name in self.placement().stages if name not in before.stages]
        event = self._resume_on(run, replan.started, ",".join(joined), "joined")
        run.report("grown", f"{', '.join(joined) or 'a stage'} joined: re-planned in {event['replan_s']:.2f} s: "
                            f"{event['chain']}; {_replay_text(event)}",
                   duration_s=event["replan_s"], replay_layers=event["replay_layers"])

    def _abandon_replan(self) -> None:
        """The chain broke (or the run ends) while a re-plan ran beside it: the recovery plans anew, and stages
        that joined are considered again (between runs, or in the next run)."""
        if self._replan is not None:
            self._replan.conversation.cancel()
            self.replanner.keeper.placed_among.difference_update(stage.name for stage in self._replan.joined)
            self._replan = None

    def _recover(self, run: RunState, lost: StageLost) -> bool:
        """Re-plan without the lost stage, then re-prefill every active sequence. False: stopping."""
        if self.replanner is None:
            raise lost
        started = self.clock()
        run.report("stage_lost", str(lost), stage=lost.stage.name)
        run.inflight.clear()  # whatever was in flight is dropped; the re-prefill redoes it
        before = self.placement()
        if self.replanner.recover(lost, run.should_stop, run.report) is None:  # marks it lost, re-plans, reloads
            return False
        event = self._resume_on(run, started, lost.stage.name, lost.reason)
        if lost.stage.name in before.stages:
            event["lost_span"] = before.spans[before.stages.index(lost.stage.name)].to_json()
        run.report("recovered", f"re-planned without {lost.stage.name} in {event['replan_s']:.2f} s: "
                                f"{event['chain']}; {_replay_text(event)}",
                   stage=lost.stage.name, duration_s=event["replan_s"], replay_layers=event["replay_layers"])
        return True

    def _resume_on(self, run: RunState, started: float, stage: str, reason: str) -> dict:
        """Go on with the owner's freshly loaded placement: steps in flight belong to the old epoch
        (its stages drop them), every active sequence replays what the stages did not keep (the
        layers in broker.replay_window, or all of them), the drift watch takes a new baseline. Returns
        the re-plan's event, which the first new token and the end of the re-prefill complete."""
        run.inflight.clear()
        self._follow_placement()
        self.drift.restart(self.clock(), self._stage_stats(), self.work)
        placement = self.placement()
        window = self._replay_window(run, placement)
        if window is None:
            tokens = 0  # every stage kept the caches of all its layers
        elif window.start == 0 and window.end == placement.spans[-1].end:
            tokens = run.scheduler.reset_caches()
        else:
            tokens = run.scheduler.replay_layers((window.start, window.end))
        event = {"stage": stage, "reason": reason, "started": started, "replan_s": round(self.clock() - started, 3),
                 "reprefill_tokens": tokens, "chain": placement.text(), "placement": placement,
                 "replay_layers": window.to_json() if window is not None else None}
        run.stats.recoveries.append(event)
        run.awaiting_first_token = run.replay_event = event
        return event


    def _replay_window(self, run: RunState, placement: Placement) -> LayerRange | None:
        """The layers to recompute after this re-plan (broker.replay_window): every layer when the
        sequences cannot replay part of them, or the stages kept nothing that helps."""
        every = LayerRange(0, placement.spans[-1].end)
        if not self.batching.keep_caches or not run.scheduler.can_replay_layers():
            return every
        stages = [StageCaches(span, stage.kept, stage.outputs_at) for span, stage in zip(placement.spans, self.chain)]
        return replay_window(every.end, stages)

    def _replay_every_layer(self, run: RunState, error: str) -> None:
        """A replay step failed (a stage without what it should have kept): recompute every layer of
        every sequence instead. Steps in flight are dropped first: a replay step's result must not
        count once the sequences start over."""
        log.warning("a replay of the moved layers failed (%s): recomputing every layer instead", error)
        run.report("replay_failed", f"the replay of the moved layers failed ({error}); recomputing every layer")
        run.inflight.clear()
        tokens = run.scheduler.reset_caches()
        if run.replay_event is not None:
            run.replay_event["reprefill_tokens"] = tokens
            run.replay_event["replay_layers"] = None



def _replay_text(event: dict) -> str:
    """What a re-plan recomputes, for its event's message."""
    layers, tokens = event.get("replay_layers"), event["reprefill_tokens"]
    if layers is None:
        return "every stage kept its caches: nothing to recompute"
    if layers[0] == 0 and layers[1] == event["placement"].spans[-1].end:
        return f"re-prefilling {tokens} tokens"
    return (f"replaying {tokens} cached positions over layers [{layers[0]}, {layers[1]}) only "
            "(the stages kept the other layers' caches)")
