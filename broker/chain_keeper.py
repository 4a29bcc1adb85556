"""Which stage serves which layers: the broker's placement in use, and how it is made.

The keeper measures the stages (their profiles, the links between them), asks the planner for a
placement, has the stages load it and keeps it, one `Placement` swapped whole on every re-plan. What to
place where is decided by the pure functions of `layerbus.planner`; the keeper measures, loads, logs and
reports around them. Measuring is written as conversations (broker/waits.py), so the same code runs while
nothing else does (the broker starting, re-planning after a loss) and beside the chain's work (a stage
that joins mid-job, broker/replanning.py).
"""

from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from layerbus.broker.control import ClusterError, ControlPlane, StageInfo, StageLost, StageState
from layerbus.broker.job_simulation import job_shape
from layerbus.broker.link_probing import LinkProbeConfig, MeasuredLink, link_probe_steps
from layerbus.broker.profiling import (
    ProfilingConfig,
    measure_sharing,
    probe_bytes_of,
    profile_request,
    profile_steps,
    tick_layers_of,
)
from layerbus.broker.run_state import BrokerCounts
from layerbus.broker.trace_file import BrokerTrace
from layerbus.broker.waits import Computed, Liveness, Steps, run_blocking
from layerbus.models.model_info import ModelInfo
from layerbus.planner.batch_sizing import choose_by_plan
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.chain import Placement
from layerbus.planner.model_memory import model_memory
from layerbus.planner.network import HostLinks, Link, LinkMatrix, live_matrix
from layerbus.planner.partition import model_cost_from_config
from layerbus.planner.placement import Plan, PlanOptions, StageProfile
from layerbus.planner.plan_report import format_link_matrix, format_plan
from layerbus.planner.planning import (
    PlanInputs,
    link_codec_inputs,
    one_chain_planner,
    plan_chain,
    planned,
    profiles_of,
    stage_weights,
    unplanned_spans,
    unprofiled,
    without_stage,
)
from layerbus.planner.weight_choice import AUTO_FALLBACKS
from layerbus.planner.wire_choice import AutoWireInputs, plan_link_codecs
from layerbus.planner.workload import Workload, mean_decode_context
from layerbus.wire.trace_events import PLACE

log = logging.getLogger("layerbus.broker")
PARTITIONS = ("planned", "balanced", "equal")


@dataclass(frozen=True)
class KeeperConfig:
    """What the keeper needs of the broker's configuration (broker.broker.BrokerConfig says each)."""

    partition: str
    plan_options: PlanOptions
    profiling: ProfilingConfig
    link_probe: LinkProbeConfig
    liveness: Liveness  # when a stage waited for counts as lost
    min_gain: float  # a re-plan that moves survivors must be this much faster (the drift watch's)
    load_timeout_s: float
    wire: tuple[str, ...] | str
    wire_auto: AutoWireInputs
    weights: str
    workload: Workload | None
    network: HostLinks | None


class ChainKeeper:
    def __init__(self, config: KeeperConfig, model: ModelInfo, control: ControlPlane, requested: BatchingConfig,
                 batching: BatchingConfig, batching_reasons: list[str], results_address: str, step_bytes: int,
                 step_rows: int, counts: BrokerCounts, tracer: BrokerTrace | None = None):
        self.config, self.model, self.control = config, model, control
        self.requested_batching, self.batching, self.batching_reasons = requested, batching, batching_reasons
        self.results_address, self.step_bytes, self.step_rows = results_address, step_bytes, step_rows
        self.counts, self.tracer = counts, tracer
        self.max_context = requested.max_context
        self.placement: Placement | None = None  # the chain in use; replaced whole, never changed in place
        self.profiles: tuple[StageProfile, ...] = ()  # every registered stage's profile ("planned"), for re-planning
        # Each ordered pair of live stages -> the link the sender timed to the receiver (broker.link_probing);
        # kept across re-plans, a lost stage's pairs dropped. `links_timed` counts every pair ever timed.
        self.measured_links: dict[tuple[str, str], MeasuredLink] = {}
        self.links_timed = 0
        # The live stages when the placement in use was made (those it left out included): a stage not
        # among them registered since (started mid-job, or back after it was lost) and may join.
        self.placed_among: set[str] = set()
        self._chain: list[StageInfo] = []  # the StageInfo of each stage of the placement, as they loaded it
        # Plans computed beside a running pipeline (a stage that joined, one that slowed): pure work.
        self.planning = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerbus-planning")

    # -- the placement in use -------------------------------------------------------------------
    @property
    def chain(self) -> list[StageInfo]:
        """The stages of the placement in use, in chain order: the processes that loaded it (a process that
        registers later under one of their names is another stage, and this one says it is gone)."""
        if self.placement is None:
            return []
        return self._chain or [self.control.stage(name) for name in self.placement.stages]

    @property
    def plan(self) -> Plan | None:
        return self.placement.plan if self.placement else None

    # -- measuring -------------------------------------------------------------------------------
    def profile(self, stages: list[StageInfo], corun_probe: bool = True, watch: Callable[[], None] = lambda: None) -> bool:
        """Measure the stages not profiled yet and time the links not timed yet (what placing them starts
        with); `profiles` then holds every stage's, in name order, each carrying the weight format its stage
        was asked for (the planner sizes its weights in it). True when some were measured. A stage that
        cannot be measured raises NoReply, one lost meanwhile StageLost (`watch` raises it for stages other
        than the one asked: the caller drops it and places again, with the profiles taken so far kept).
        Without `corun_probe`, how much stages of one machine slow each other is not measured again."""
        stages = sorted(stages, key=lambda s: s.name)
        missing = unprofiled([stage.name for stage in stages], self.profiles)
        request, probe_bytes = self._profile_request()
        measured = False
        for stage in stages:  # timed alone, one after another, each kept as soon as it is measured
            if stage.name in missing:
                self.control.phase = f"profiling stage {stage.name}"
                config = replace(self.config.profiling, probe_s=0)
                profile = run_blocking(self.control, profile_steps(self.control, stage, request, probe_bytes, config),
                                       self.config.liveness, watch)
                self._keep_profile(profile, stage)
                measured = True
        config = self.config.profiling
        if measured and config.probe_s > 0 and corun_probe:
            # Over every stage of each machine: one that joined stages profiled before changes what sharing
            # costs each of them, not only itself.
            self.control.phase = "measuring how the stages share their machines"
            profiles = measure_sharing(self.control, stages, list(profiles_of([s.name for s in stages], self.profiles)),
                                       request, config.probe_s, config.timeout_s, rounds=config.sharing_rounds,
                                       tick_layers=tick_layers_of(self._memory(stages), len(stages)),
                                       liveness=self.config.liveness)
            by_name = {p.name: p for p in profiles}
            self.profiles = tuple(by_name.get(p.name, p) for p in self.profiles)
        self.time_links(stages, watch)
        self.profiles = tuple(profiles_of([stage.name for stage in stages], self.profiles))
        return measured

    def profile_newcomer_steps(self, stage: StageInfo) -> Steps[StageProfile]:
        """The conversation that profiles one stage that joined mid-job, keeping its profile."""
        request, probe_bytes = self._profile_request()
        profile = yield from profile_steps(self.control, stage, request, probe_bytes,
                                           replace(self.config.profiling, probe_s=0))
        self._keep_profile(profile, stage)
        return profile

    def _profile_request(self) -> tuple[dict, int]:
        """The PROFILE fields, timed at the sizes asked for (or, left to choose, the defaults: the fitted costs
        price any other), and a link probe's payload."""
        requested = self.requested_batching
        rows = self.batching.micro_batch_size if requested.num_slots or requested.micro_batch_size else 32
        steps = requested.max_step_tokens or 256
        request = profile_request(str(self.model.path), rows, steps, self.max_context, self.config.profiling,
                                  self.config.weights)
        return request, probe_bytes_of(self._memory(), rows, steps)

    def _keep_profile(self, profile: StageProfile, stage: StageInfo) -> None:
        profile = replace(profile, weights=stage.own_weights or self.config.weights)
        self.profiles = tuple(sorted((*(p for p in self.profiles if p.name != profile.name), profile),
                                     key=lambda p: p.name))

    def time_links(self, stages: list[StageInfo], watch: Callable[[], None] = lambda: None) -> None:
        """Have the stages time the links between them that are not measured yet (a new stage's)."""
        if not self.config.link_probe.enabled or len(stages) < 2:
            return
        self.control.phase = "timing the links between stages"
        timed = run_blocking(self.control, self.link_steps(stages), self.config.liveness, watch)
        self.note_links(timed)

    def link_steps(self, stages: list[StageInfo]) -> Steps[dict]:
        return link_probe_steps(self.control, stages, self.measured_links, self.step_bytes, self.step_rows,
                                self.config.link_probe)

    def note_links(self, timed: dict) -> None:
        self.measured_links.update(timed)
        self.links_timed += len(timed)
        if timed:
            for line in self.link_matrix_report().splitlines():
                log.info("%s", line)

    def link_matrix(self, stages: list[StageInfo] | None = None) -> LinkMatrix | None:
        """The links the planner prices over `stages` (default: every live stage): a network file's where
        it covers a pair, else the stages' measured ones, the broker's probe of each stage between it and
        the broker. None without a network file and without measured pairs: each stage's own link."""
        stages = self.control.live_stages() if stages is None else stages
        hosts = {stage.name: stage.host for stage in stages}
        measured = {pair: link.link() for pair, link in self.measured_links.items()
                    if pair[0] in hosts and pair[1] in hosts}
        if self.config.network is None and not measured:
            return None
        broker_links = {p.name: Link(p.link_bandwidth, p.link_latency_s) for p in self.profiles if p.name in hosts}
        return live_matrix(hosts, measured, broker_links, self.config.network, socket.gethostname())

    def link_matrix_report(self) -> str:
        """The matrix of the placement in use's stages and the spares, for the job's events ("" without one)."""
        matrix = self.link_matrix()
        return format_link_matrix(matrix, [s.name for s in self.control.live_stages()]) if matrix is not None else ""

    def forget(self, stage: StageInfo) -> None:
        """A lost stage serves no more; if it registers again it is measured anew."""
        self.control.mark_lost(stage)
        self.placed_among.discard(stage.name)  # back under its name later, it is a stage that joins
        before = {p.name: p.corun_factor for p in self.profiles}
        self.profiles = without_stage(self.profiles, stage.name)
        dropped = sorted(p.name for p in self.profiles if p.corun_factor != before[p.name])
        if dropped:
            log.info("co-run factors of %s dropped: measured beside %s; the plan reckons their sharing from "
                     "threads and cores", ", ".join(dropped), stage.name)
        self.measured_links = {pair: link for pair, link in self.measured_links.items() if stage.name not in pair}

    # -- planning --------------------------------------------------------------------------------
    def place(self, stages: list[StageInfo], watch: Callable[[], None] = lambda: None) -> Placement:
        """The placement over these stages (not loaded yet). "planned" profiles the stages it has no profile
        of and may leave some out (they stay registered, as spares); it raises PlacementError when the
        stages cannot hold the model, NoReply or StageLost for a stage that could not be measured."""
        stages = self.in_chain_order(stages)
        names = [stage.name for stage in stages]
        if self.config.partition != "planned":
            return unplanned_spans(self.config.partition, names, self.model.files.num_layers,
                                   model_cost_from_config(self.model.files.config))
        measured = self.profile(stages, watch=watch)
        inputs = self.plan_inputs(stages)
        if self.placement is not None:
            # A re-plan moves the survivors only for a plan faster by as much as the drift watch asks before it
            # moves layers: a new order loses the caches they kept, and every layer is computed again.
            reorder = max(inputs.options.reorder_tolerance, self.config.min_gain)
            inputs = replace(inputs, options=replace(inputs.options, reorder_tolerance=reorder))
        self.control.phase = "planning"
        if measured and self.placement is None and self.requested_batching.chosen_by_broker:
            # Chosen once, with the first profiles: the stages size their KV caches for these slots.
            plan = self._computed(lambda: self._size_batches(names, stages), watch)
        else:
            plan = self._computed(lambda: plan_chain(names, self.profiles, replace(self.plan_inputs(stages),
                                                                                   options=inputs.options)), watch)
        for reason in self.batching_reasons:
            log.info("batching: %s", reason)
        for line in format_plan(plan).splitlines():
            log.info("%s", line)
        return planned(plan)

    def in_chain_order(self, stages: list[StageInfo]) -> list[StageInfo]:
        """A stable order for reproducible logs: by name, but a re-plan lists the chain in use first, in its
        order. The planner keeps the order it is given where that is within reorder_tolerance of the best,
        and survivors that keep their places keep their caches (broker.replay_window)."""
        position = {name: i for i, name in enumerate(self.placement.stages)} if self.placement is not None else {}
        return sorted(stages, key=lambda s: (position.get(s.name, len(position)), s.name))

    def _computed(self, compute: Callable, watch: Callable[[], None]):
        """`compute()` (pure planning, seconds on a large job) on the planning thread, while this one keeps
        judging the control plane (the control thread answers the stages either way)."""
        def wait() -> Steps:
            return (yield Computed(self.planning.submit(compute)))

        return run_blocking(self.control, wait(), self.config.liveness, watch)

    def _size_batches(self, names: list[str], stages: list[StageInfo]) -> Plan:
        """Choose the sizes left to the broker (each candidate count of micro-batches planned, the
        fastest predicted kept: planner.batch_sizing.choose_by_plan); the plan for them."""
        def plan_for(batching: BatchingConfig) -> Plan:
            self.batching = batching
            return plan_chain(names, self.profiles, self.plan_inputs(stages))

        workload = self.config.workload
        sizing, plan = choose_by_plan(self.requested_batching, len(names), self.profiles, self._memory(stages),
                                      plan_for, workload.items if workload else None, mean_decode_context(workload),
                                      self.config.plan_options.reserve_fraction)
        self.batching, self.batching_reasons = sizing.batching, sizing.reasons
        return plan

    def chain_planner(self, stages: list[StageInfo]):
        """A planner of one chain over some of `stages` (profiled), beside other chains' stages, with the
        batch sizes this broker would choose for that chain (planning.one_chain_planner). Pure once made:
        it touches no socket."""
        inputs = self.plan_inputs(stages)
        return one_chain_planner(self.requested_batching, inputs.memory, inputs.options, inputs.network,
                                 self.config.workload, job_shape)

    def plan_inputs(self, stages: list[StageInfo]) -> PlanInputs:
        dtypes = sorted({stage.dtype for stage in stages})
        if len(dtypes) > 1:
            log.warning("stages run different dtypes %s; memory is planned for %s", dtypes, stages[0].dtype)
        workload = self.config.workload
        job = job_shape(workload, self.batching) if workload is not None and workload.items else None
        return PlanInputs(self.model.path.name, self._memory(stages), self.batching, self.config.plan_options, job,
                          self.link_matrix(stages))

    def _memory(self, stages: list[StageInfo] | None = None):
        dtype = stages[0].dtype if stages else "float32"
        return model_memory(self.model.files, dtype)

    # -- loading ---------------------------------------------------------------------------------
    def assign(self, placement: Placement, context_hint: int) -> None:
        """Choose the links' codecs, make `placement` the one in use and have its stages load it."""
        config = self.config
        wire, auto = link_codec_inputs(config.wire, config.wire_auto, placement, self.profiles)
        codecs = plan_link_codecs(wire, len(placement.stages) - 1, self.step_bytes, str(self.model.path), auto)
        self.placement = placement.with_codecs(codecs)
        self.placed_among = {stage.name for stage in self.control.live_stages()}
        if placement.plan is not None and config.plan_options.max_auto_level > 0:
            # Re-plans keep the precision this first placement chose (see PlanOptions.max_auto_level).
            quantized = {stage.weights for stage in placement.plan.stages} & set(AUTO_FALLBACKS)
            level = max((AUTO_FALLBACKS.index(name) + 1 for name in quantized), default=0)
            self.config = replace(config, plan_options=replace(config.plan_options, max_auto_level=level))
        log.info("placing %s: %s", self.model.path, self.placement.text())
        self.control.phase = "loading the layers"
        if self.tracer is not None:
            self.tracer.placed(self.placement, {stage.name: stage.host for stage in self.chain})
            began = self.tracer.now()
        self._chain = []
        self._chain = self.control.assign(self.placement, str(self.model.path), self.results_address,
                                          self.batching.num_slots, self.max_context, config.load_timeout_s,
                                          liveness_window_s=config.liveness.window_s,
                                          weights=stage_weights(self.placement, config.weights),
                                          keep_caches=self.batching.keep_caches, context_hint=context_hint)
        self.control.phase = None
        if self.tracer is not None:
            self.tracer.span("load spans", PLACE, began, self.tracer.now(), chain=self.placement.text())

    def assign_mid_run(self, placement: Placement, context_hint: int, blamed: StageInfo | None) -> None:
        """Load a re-plan while the job runs. A stage that cannot load its new span is reported lost (the
        failed one, else `blamed`, else the chain's first), so the pipeline re-plans without it."""
        try:
            self.assign(placement, context_hint)
        except StageLost:
            raise
        except ClusterError as error:
            failed = next((stage for stage in self.chain if stage.state is StageState.FAILED), blamed or self.chain[0])
            raise StageLost(failed, f"could not load its new span: {error}") from None

    def joined_stages(self) -> list[StageInfo]:
        """Live stages that registered after the placement in use was made: started mid-job (`layerbus stage
        --broker` pointed here), or back under their name after they were lost."""
        if self.placement is None:
            return []
        return [stage for stage in self.control.live_stages()
                if stage.name not in self.placed_among and stage.state is StageState.SPARE]

    def close(self) -> None:
        self.planning.shutdown(wait=False, cancel_futures=True)
