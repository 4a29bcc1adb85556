"""Re-plans while a job runs: after a stage is lost, when one slows, when one joins.

A lost stage stops the chain, so its re-plan (`recover`) runs here and now: it measures what it must, plans
over the stages left and loads the new spans, waiting for a stage to register while the rest cannot hold
the model. A stage that cannot be measured meanwhile (it dies, falls silent, or answers that it cannot) is
dropped from consideration with an event, and the plan is made again without it: a spare never sinks a job.

A stage that slows or joins does not stop the chain, so their re-plans are conversations
(broker/waits.py) that the pipeline loop runs beside its steps: the newcomer is profiled and its links
timed, the plan is computed on the planning thread, and only a placement worth moving to is loaded.
"""

from __future__ import annotations

import logging
from typing import Callable

from layerbus.broker.chain_keeper import ChainKeeper
from layerbus.broker.control import ClusterError, StageInfo, StageLost, StagesGone, StageState, lost_reason
from layerbus.broker.waits import Computed, NoReply, Steps, run_blocking
from layerbus.planner.chain import Placement
from layerbus.planner.drift import Work
from layerbus.planner.placement import PlacementError
from layerbus.planner.plan_report import format_plan
from layerbus.planner.planning import expected_busy_s, planned, replan_slowed

log = logging.getLogger("layerbus.broker")
Report = Callable[..., None]  # report(kind, message, **fields): the job's events


def _quiet(*_args, **_fields) -> None:
    pass


class Replanner:
    """The broker's re-plans over its ChainKeeper (see the module docstring)."""

    def __init__(self, keeper: ChainKeeper, context_hint: Callable[[], int]):
        self.keeper, self.control, self.counts = keeper, keeper.control, keeper.counts
        self.context_hint = context_hint  # positions the job's longest item reaches (KV caches are made that long)

    # -- a lost stage ----------------------------------------------------------------------------
    def recover(self, lost: StageLost, should_stop: Callable[[], bool] = lambda: False,
                report: Report = _quiet) -> Placement | None:
        """Re-plan over the stages still alive (spares and stages that registered since included), load the
        new spans, and return the new placement. While they cannot hold the model (none left, or too little
        memory), wait for a stage to register. A stage lost or failing while measured or loading is dropped
        too, and the plan made again. None when `should_stop` says so."""
        self.drop(lost.stage)
        waiting_for: str | None = None
        timed_before = self.keeper.links_timed
        while not should_stop():
            candidates = [s for s in self.control.live_stages() if s.state is not StageState.FAILED]
            try:
                if not candidates:
                    raise PlacementError("no stage is left")
                placement = self.keeper.place(candidates, watch=self._watching(candidates))
            except PlacementError as why:
                model = self.keeper.model.path.name
                reason = (f"the stages left cannot hold {model} ({why}); waiting for a stage to register at "
                          f"{self.control.address} (`layerbus stage --broker {self.control.address}`)")
                if reason != waiting_for:
                    report("waiting", reason)
                    waiting_for = reason
                self.control.phase = "waiting for a stage: the stages left cannot hold the model"
                self._wait_for_registration(should_stop)
                continue
            except (StageLost, NoReply) as gone:  # measured, or waited beside one measured: left out
                self.drop(gone.stage)
                lost = gone if isinstance(gone, StageLost) else StageLost(gone.stage, gone.reason)
                report("stage_lost", f"{lost} (while the broker measured the stages for a re-plan); placing "
                                     "again without it", stage=gone.stage.name)
                continue
            try:
                self.keeper.assign(placement, self.context_hint())
                self.counts.replans_lost += 1
                if self.keeper.links_timed > timed_before:  # a stage joined: its links were timed for this plan
                    report("links", self.keeper.link_matrix_report())
                return self.keeper.placement
            except StageLost as again:
                self.drop(again.stage)
                report("stage_lost", f"{again} (while loading a new span)", stage=again.stage.name)
            except ClusterError as error:  # a load failed: that stage is left out of the next plan
                report("load_failed", str(error))
        return None

    def check_spares(self, liveness_window_s: float, stuck_s: float, report: Report = _quiet) -> None:
        """A stage outside the chain (a spare, or one waiting to join) that died or fell silent is dropped and
        said, as a lost stage of the chain is: the next re-plan does not count on it."""
        chain = {stage.name for stage in self.keeper.chain}
        now = self.control.clock()
        departed, self.control.departed = self.control.departed, []
        for stage in departed:  # ended, left, or restarted under its name: no longer among the live stages
            if any(stage is member for member in self.keeper.chain) or stage.state is not StageState.GONE:
                continue  # the chain's own are found by check_stages; a LOST one was dropped and said already
            self.drop(stage)
            report("stage_lost", f"stage {stage.name} ({stage.host} pid {stage.pid}), a spare, lost: "
                                 f"{stage.error or 'it left (stopped or shut down)'}", stage=stage.name)
        for stage in self.control.live_stages():
            if stage.name in chain or stage.state is StageState.LOADING:
                continue
            reason = lost_reason(stage, now, liveness_window_s, stuck_s)
            if reason is not None:
                self.drop(stage)
                report("stage_lost", f"stage {stage.name} ({stage.host} pid {stage.pid}), a spare, lost: {reason}",
                       stage=stage.name)

    def drop(self, stage: StageInfo) -> None:
        """A stage lost: counted, forgotten (measured anew if it registers again)."""
        self.keeper.forget(stage)
        self.counts.stages_lost += 1

    def _watching(self, stages: list[StageInfo]) -> Callable[[], None]:
        """Raises StageLost for the first of `stages` gone silent or gone while another is measured."""
        liveness = self.keeper.config.liveness
        return lambda: self.control.check_stages([s for s in stages if s.state.alive or s.state is StageState.GONE],
                                                 liveness.window_s, liveness.stuck_s)

    def _wait_for_registration(self, should_stop: Callable[[], bool]) -> None:
        """Until another stage registers. StagesGone when every stage process this broker was told of has ended
        for good: none can come."""
        known = self.control.registered  # a stage restarted under its name registers anew too
        while self.control.registered == known and not should_stop():
            self.control.poll(200)
            if self.control.none_can_come_back():
                raise StagesGone(f"every stage has ended and none can come back: {self.control.stages_missing()}")

    # -- a slowed stage --------------------------------------------------------------------------
    def rebalance_steps(self, slowed: dict[str, float], report: Report = _quiet) -> Steps[Placement | None]:
        """A stage runs `factor` times slower than it did: plan again with its profile slowed as much (on the
        planning thread), and return the plan to move to if it is at least the drift watch's gain faster than
        the placement in use (re-loading spans and re-prefilling cost something); None otherwise."""
        keeper = self.keeper
        if keeper.plan is None:  # "balanced" and "equal" have no measured profiles to re-plan from
            return None
        live, chain = self.control.live_stages(), keeper.chain
        inputs = keeper.plan_inputs(chain)
        decision = yield Computed(keeper.planning.submit(
            replan_slowed, slowed, keeper.placement, [s.name for s in live], keeper.profiles, inputs,
            keeper.config.min_gain))
        keeper.profiles = decision.profiles
        if decision.best is not None:
            log.info("slowed %s: placement in use %.1f ms per step, best plan %.1f ms (%.0f%% faster)",
                     slowed, decision.current_step_s * 1e3, decision.best.step_s * 1e3, decision.gain * 100)
        if decision.plan is None:
            return None
        for line in format_plan(decision.plan).splitlines():
            log.info("%s", line)
        self.counts.replans_slowed += 1
        return planned(decision.plan)

    # -- a stage that joined ---------------------------------------------------------------------
    def grow_steps(self, joined: list[StageInfo], report: Report = _quiet) -> Steps[Placement | None]:
        """Put stages that joined mid-job to work: with --partition planned, profile them (alone), time their
        links, and return the best plan over every live stage if it is at least the drift watch's gain faster
        than the placement in use; else they stay spares, ready for the next re-plan (None). With equal or
        balanced the user asked for every stage: the split is made again over all. A newcomer that cannot be
        measured ends it with NoReply or StageLost naming that stage (Pipeline drops it, the job goes on)."""
        keeper = self.keeper
        names = ", ".join(stage.name for stage in joined)
        keeper.placed_among.update(stage.name for stage in joined)  # considered once: no re-plan per loop
        if keeper.config.partition != "planned":
            self.counts.replans_joined += 1
            return keeper.place([s for s in self.control.live_stages() if s.state is not StageState.FAILED])
        for stage in joined:
            yield from keeper.profile_newcomer_steps(stage)
        live = [s for s in self.control.live_stages() if s.state is not StageState.FAILED]
        if keeper.config.link_probe.enabled and len(live) > 1:
            keeper.note_links((yield from keeper.link_steps(live)))
        inputs = keeper.plan_inputs(live)
        min_gain = keeper.config.min_gain
        decision = yield Computed(keeper.planning.submit(
            replan_slowed, {}, keeper.placement, [s.name for s in live], keeper.profiles, inputs, min_gain))
        if decision.plan is None:
            best = f"{decision.best.step_s * 1e3:.1f} ms per step" if decision.best is not None else "none fits"
            report("joined", f"{names} registered mid-job; the best plan with it ({best}) is not at least "
                             f"{min_gain:.0%} faster than the placement in use ({decision.current_step_s * 1e3:.1f} "
                             f"ms): kept as a spare for the next re-plan")
            return None
        for line in format_plan(decision.plan).splitlines():
            log.info("%s", line)
        self.counts.replans_joined += 1
        return planned(decision.plan)

    def left_out(self, joined: list[StageInfo], error: BaseException, report: Report = _quiet) -> None:
        """A stage that joined could not be measured (it died, fell silent, or answered that it could not):
        it is dropped with an event, and the chain goes on as it was."""
        stage = getattr(error, "stage", None)
        names = ", ".join(s.name for s in joined)
        lost = isinstance(error, StageLost)
        said = False  # a stage that died or fell silent while measured is a lost stage, said as every one is
        if isinstance(stage, StageInfo) and stage.state.alive and not lost:
            stage.state, stage.error = StageState.FAILED, str(error)  # answered, but cannot serve
        elif isinstance(stage, StageInfo) and stage.state.alive:  # not dropped and said already (check_spares)
            self.drop(stage)
            said = True
        report("stage_lost" if said else "joined",
               f"{names} registered mid-job but could not be measured ({error}): left out, the job goes on",
               **({"stage": stage.name} if isinstance(stage, StageInfo) else {}))

    def load(self, placement: Placement, blamed: StageInfo | None) -> Placement:
        """Load a placement a conversation chose, mid-run; the keeper's placement in use, once loaded."""
        self.keeper.assign_mid_run(placement, self.context_hint(), blamed)
        return self.keeper.placement

    def expected_busy_s(self, stage_name: str, work: Work) -> float:
        """For the drift watch: the profile's price of `work` on this stage (0 without a plan)."""
        return expected_busy_s(self.keeper.plan, self.keeper.profiles, stage_name, work)

    # -- between jobs ----------------------------------------------------------------------------
    def keep_alive(self, seconds: float, liveness_window_s: float, stuck_s: float, report: Report = _quiet,
                   should_stop: Callable[[], bool] = lambda: False) -> None:
        """Between jobs: re-plan when a stage is lost, and put a stage that joined to work (the next run
        follows, on the new chain). While the stages left cannot hold the model it waits for one to register,
        until `should_stop` says so: then it returns early, the lost stage still in the placement (found lost
        again on the next call)."""
        deadline = self.control.clock() + seconds
        while self.control.clock() < deadline:
            self.control.poll(100)
            try:
                self.control.check_stages(self.keeper.chain, liveness_window_s, stuck_s)
                self.check_spares(liveness_window_s, stuck_s, report)
                self._grow_between_runs(liveness_window_s, stuck_s, report)
            except StageLost as lost:
                report("stage_lost", str(lost), stage=lost.stage.name)
                started = self.control.clock()
                if self.recover(lost, should_stop=should_stop, report=report) is None:
                    return
                report("recovered", f"re-planned without {lost.stage.name} between runs: "
                                    f"{self.keeper.placement.text()}",
                       stage=lost.stage.name, duration_s=self.control.clock() - started)

    def _grow_between_runs(self, liveness_window_s: float, stuck_s: float, report: Report) -> None:
        """Stages that joined while no run was going are measured here and now (no step waits for them); a
        plan with them that is enough faster is loaded before the next run. StageLost for a stage of the
        chain lost meanwhile."""
        joined = self.keeper.joined_stages()
        if not joined:
            return
        started = self.control.clock()
        chain = self.keeper.chain
        watch = lambda: self.control.check_stages(chain, liveness_window_s, stuck_s)  # noqa: E731
        try:
            placement = run_blocking(self.control, self.grow_steps(joined, report), self.keeper.config.liveness, watch)
        except StageLost as lost:
            if lost.stage.name in {stage.name for stage in chain}:
                raise
            self.left_out(joined, lost, report)
            return
        except ClusterError as error:
            self.left_out(joined, error, report)
            return
        if placement is None:
            return
        self.load(placement, joined[0])
        names = ", ".join(stage.name for stage in joined)
        report("grown", f"{names} joined: re-planned in {self.control.clock() - started:.2f} s: "
                        f"{self.keeper.placement.text()}; between runs, so nothing to recompute",
               duration_s=self.control.clock() - started)
