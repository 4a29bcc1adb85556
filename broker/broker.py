"""The broker: owns the control plane, the placement in use (one `Placement`, swapped whole on a
re-plan), the schedule and the result socket. What to place where is decided by the pure functions
of planner.planning; the broker measures, loads, logs and reports around them."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, TypeVar

import zmq

from layerbus.planner.chain import Placement
from layerbus.planner.weight_choice import AUTO_FALLBACKS
from layerbus.broker.control import ClusterError, ControlPlane, StageInfo, StageLost, StageState
from layerbus.planner.drift import Work
from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.planner.model_memory import model_memory
from layerbus.broker.link_probing import LinkProbeConfig, MeasuredLink, probe_links
from layerbus.planner.network import HostLinks, Link, LinkMatrix, live_matrix
from layerbus.planner.partition import model_cost_from_config
from layerbus.broker.pipeline import Pipeline, PipelineConfig
from layerbus.planner.placement import PlacementError, Plan, PlanOptions, StageProfile, estimate_split
from layerbus.planner.batch_sizing import choose_batching, choose_by_plan
from layerbus.planner.plan_report import format_link_matrix, format_plan, format_prediction, prediction_report
from layerbus.planner.planning import (
    PlanInputs,
    expected_busy_s,
    link_codec_inputs,
    one_chain_planner,
    plan_chain,
    planned,
    profiles_of,
    replan_slowed,
    stage_weights,
    unplanned_spans,
    unprofiled,
    without_stage,
)
from layerbus.broker.profiling import ProfilingConfig, collect_profiles, measure_sharing, profile_request, tick_layers_of
from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.broker.run_state import BrokerCounts, ListSource, RecordingSink, RecordingSource, RequestSource, ResultSink, RunStats
from layerbus.planner.batching import BatchingConfig
from layerbus.broker.stage_view import StageView
from layerbus.broker.trace_file import BrokerTrace
from layerbus.planner.wire_choice import AutoWireInputs, plan_link_codecs
from layerbus.planner.workload import Workload, mean_decode_context
from layerbus.broker.job_simulation import job_shape
from layerbus.models.model_info import ModelInfo, load_tokenizer, read_model_info
from layerbus.storage.snapshot_records import StageSnapshot
from layerbus.wire.curve import ClusterKeys
from layerbus.wire.trace_events import PLACE
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import check_weight_format
from layerbus.wire.constraint import Constraint

if TYPE_CHECKING:
    from layerbus.broker.grammar import TokenGrammar

T = TypeVar("T")
log = logging.getLogger("layerbus.broker")
PARTITIONS = ("planned", "balanced", "equal")


@dataclass(frozen=True)
class BrokerConfig:
    """How the broker listens, waits for stages and splits the model."""

    model_dir: str  # Hugging Face model directory every stage can read at this path
    num_stages: int  # stages to wait for and chain
    control_bind: str = "tcp://127.0.0.1:*"  # ROUTER for registration/heartbeats ("*" = any port)
    results_bind: str = "tcp://127.0.0.1:*"  # PULL where the last stage returns tokens
    advertise_host: str | None = None  # host name stages on other machines use for results_bind
    # CURVE on every link (wire/curve.py): the broker's keypair and the stage keys it admits. None: the
    # links are neither authenticated nor encrypted (the CLI allows that on loopback binds, or --insecure).
    keys: ClusterKeys | None = None
    partition: str = "planned"  # "planned" (profiled stages, planner.placement), "balanced" (by FLOPs) or "equal"
    plan_options: PlanOptions = field(default_factory=PlanOptions)  # workload mix, reserve, reordering
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    register_timeout_s: float = 120.0  # wait this long for num_stages to register
    load_timeout_s: float = 600.0  # wait this long for the stages to load their spans
    # Codec of the hidden states on each link between stages (wire/codecs.py): one name for every
    # link, or one per link in chain order; "auto" chooses per link from `wire_auto`.
    wire: tuple[str, ...] | str = "float32"
    wire_auto: AutoWireInputs = field(default_factory=AutoWireInputs)
    # How the stages hold their layers' weights (wire.weight_formats); a stage's own --weights wins.
    weights: str = "auto"
    # Write a Trace Event (Perfetto) timeline of every step on every stage to this file (broker.trace_file):
    # after each run, and with what it has when the broker closes. None: nothing is recorded.
    trace: str | None = None
    # The job to plan for (broker.workload.Workload: its prompt lengths and output budgets): the plan
    # prices its prefill, decode and drain, and batch sizes left at 0 are chosen for it. None: a
    # steady mix (plan_options.prompt_tokens_per_new_token), as for a broker serving whatever comes.
    workload: Workload | None = None
    # What the links between hosts cost (broker.network.HostLinks, as a network file's [[links]] and
    # [network] give them): every plan prices each send by the link it crosses. A stage runs on the host
    # it registered with unless `hosts` names it. Over the pairs it covers it wins against the stages'
    # measured links (`link_probe`). None: the measured links, else each stage's own profiled link.
    network: HostLinks | None = None
    # The stages time the links between them once registered and profiled (broker.link_probing); a
    # planned partition prices each send by the link it crosses. enabled=False: each stage's own link.
    link_probe: LinkProbeConfig = field(default_factory=LinkProbeConfig)


class Broker:
    def __init__(self, config: BrokerConfig, context: zmq.Context | None = None):
        if config.partition not in PARTITIONS:
            raise ValueError(f"partition {config.partition!r} is not one of {', '.join(PARTITIONS)}")
        check_weight_format(config.weights)
        self.config = config
        self.model: ModelInfo = read_model_info(config.model_dir)
        if config.num_stages > self.model.files.num_layers:
            raise ValueError(f"{config.num_stages} stages for a model of {self.model.files.num_layers} layers: "
                             "every stage needs at least one layer; use fewer stages")
        self.max_context = min(config.batching.max_context, self.model.max_positions)
        self.requested_batching = replace(config.batching, max_context=self.max_context)
        # Sizes left at 0 are chosen from the profiles when the model is placed ("planned"); until then,
        # and for the other partitions, from the job alone (no more slots than items).
        sizing = choose_batching(self.requested_batching, config.num_stages, (), None,
                                 config.workload.items if config.workload else None)
        self.batching = sizing.batching
        self.batching_reasons = sizing.reasons
        # A secured broker has a context of its own: libzmq takes one ZAP authenticator per context.
        self._own_context = context is None and config.keys is not None
        self.context = context or (zmq.Context() if self._own_context else zmq.Context.instance())
        self.control = ControlPlane(self.context, config.control_bind, keys=config.keys)
        self.results = self.context.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        if self.control.gate is not None:
            self.control.gate.guard(self.results)
        self.results.bind(config.results_bind)
        self.results_address = self._advertised(self.results.getsockopt(zmq.LAST_ENDPOINT).decode())
        # Decode steps dominate a run's hops: a micro-batch's rows of float32 hidden states.
        self.step_rows = max(1, self.batching.num_slots // max(1, self.batching.num_micro_batches))
        self.step_bytes = self.step_rows * self.model.files.config.hidden_size * 4
        # Checked now, so a bad --wire is a usage error before any stage starts; chosen again per chain.
        plan_link_codecs(config.wire, config.num_stages - 1, self.step_bytes, config.model_dir, config.wire_auto)
        self.placement: Placement | None = None  # the chain in use; replaced whole, never changed in place
        self.profiles: tuple[StageProfile, ...] = ()  # every registered stage's profile ("planned"), for re-planning
        self.pipeline: Pipeline | None = None
        self._tokenizer = None
        self._grammars = None  # broker.grammar.GrammarCompiler, built at the first constrained request
        self.tracer = BrokerTrace(config.trace) if config.trace else None
        self.control.tracer = self.tracer
        self.last_prediction: dict | None = None  # the last run's predicted against measured (see _prediction_report)
        # (kind, message) of what went wrong while starting (a stage process ended, a stage lost while
        # loading), for the job's events: the job is not known yet when the broker starts.
        self.start_events: list[tuple[str, str]] = []
        self._exits_noted = 0
        self._stage_view = StageView()  # the stages' load between calls of stage_snapshots
        self.counts = BrokerCounts()  # stages lost, re-plans, failed and resent steps: the metrics' counters
        # Each ordered pair of live stages -> the link the sender timed to the receiver (broker.link_probing);
        # kept across re-plans, a lost stage's pairs dropped. `links_timed` counts every pair ever timed.
        self.measured_links: dict[tuple[str, str], MeasuredLink] = {}
        self.links_timed = 0
        # The live stages when the placement in use was made (those it left out included): a stage not
        # among them registered since (started mid-job, or back after it was lost) and may join (grow).
        self._placed_among: set[str] = set()

    # -- the placement in use, read-only views -------------------------------------------------
    @property
    def chain(self) -> list[StageInfo]:
        """The stages of the placement in use, in chain order (their live state)."""
        return [self.control.stage(name) for name in self.placement.stages] if self.placement else []

    @property
    def spans(self) -> list[LayerRange]:
        return list(self.placement.spans) if self.placement else []

    @property
    def plan(self) -> Plan | None:
        """The planner's figures for the placement in use ("planned"), or None."""
        return self.placement.plan if self.placement else None

    @property
    def link_codecs(self) -> list[str]:
        return list(self.placement.codecs) if self.placement else []

    def placement_summary(self) -> str:
        """The chain in one line, e.g. "stage-1 [0, 24) -int8-> stage-0 [24, 30) (planned; ...)" (the job's events)."""
        return self.placement.summary() if self.placement else "(not placed yet)"

    def run_info(self) -> dict:
        """For storage.run_info: the chain, its spans, each stage's host (as it registered), weight
        format and weight bytes (as it reported them when it loaded), and the codec of each link."""
        if not self.placement:
            return {"stages": [], "wire": []}
        info = self.placement.run_info()
        for entry in info["stages"]:
            stage = self.control.stage(entry["name"])
            entry.update(host=stage.host, weights=stage.weights, weight_bytes=stage.param_bytes)
        return info

    def stage_snapshots(self) -> list[StageSnapshot]:
        """Every registered stage as `layerbus top` shows it, with its load since the previous call
        (broker.stage_view). For one caller, on a thread of its own (jobs/snapshot_keeper.py), so the
        snapshots go on while the loop loads spans or re-plans: it only reads, and the loop replaces the
        placement and each stage's stats whole."""
        stages = list(self.control.stages.values())
        return self._stage_view.take(stages, self.placement, self.control.clock())

    @property
    def address(self) -> str:
        return self._advertised(self.control.address)

    def _advertised(self, endpoint: str) -> str:
        if self.config.advertise_host and "://" in endpoint:
            scheme, rest = endpoint.split("://", 1)
            return f"{scheme}://{self.config.advertise_host}:{rest.rsplit(':', 1)[1]}"
        return endpoint

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.model_dir)
        return self._tokenizer

    # -- placing -------------------------------------------------------------------------------
    def _place(self, stages: list[StageInfo]) -> Placement:
        """The placement over these stages (not loaded yet). "planned" profiles the stages it has no
        profile of and may leave some out (they stay registered, as spares); it raises
        PlacementError when the stages cannot hold the model."""
        # A stable chain order for reproducible logs: by name, but a re-plan lists the chain in use first, in
        # its order. The planner keeps the order it is given where that is within reorder_tolerance of the
        # best, and survivors that keep their places keep their caches (broker.replay_window).
        position = {name: i for i, name in enumerate(self.placement.stages)} if self.placement is not None else {}
        stages = sorted(stages, key=lambda s: (position.get(s.name, len(position)), s.name))
        names = [stage.name for stage in stages]
        if self.config.partition != "planned":
            return unplanned_spans(self.config.partition, names, self.model.files.num_layers,
                                   model_cost_from_config(self.model.files.config))
        inputs = self._plan_inputs(stages)
        if position:
            # A re-plan moves the survivors only for a plan faster by as much as the drift watch asks before it
            # moves layers: a new order loses the caches they kept, and every layer is computed again.
            reorder = max(inputs.options.reorder_tolerance, self.config.pipeline.drift.min_gain)
            inputs = replace(inputs, options=replace(inputs.options, reorder_tolerance=reorder))
        measured = self.profile(stages)
        plan = None
        if measured and self.placement is None and self.requested_batching.chosen_by_broker:
            # Chosen once, with the first profiles: the stages size their KV caches for these slots.
            plan = self._heartbeating(lambda: self._size_batches(names, stages, inputs.memory))
        for reason in self.batching_reasons:
            log.info("batching: %s", reason)
        plan = plan or self._heartbeating(lambda: plan_chain(names, self.profiles, replace(self._plan_inputs(stages),
                                                                                          options=inputs.options)))
        for line in format_plan(plan).splitlines():
            log.info("%s", line)
        return planned(plan)

    def profile(self, stages: list[StageInfo], corun_probe: bool = True) -> bool:
        """Measure the stages not profiled yet and time the links not timed yet (what placing them
        starts with); `self.profiles` then holds every stage's, in name order, each carrying the weight
        format its stage was asked for (the planner sizes its weights in it). True when some were measured.
        Without `corun_probe`, how much stages of one machine slow each other is not measured again (mid-job,
        the stages in use hold their spans and caches: the probe would load layers beside them)."""
        stages = sorted(stages, key=lambda s: s.name)
        names = [stage.name for stage in stages]
        missing = set(unprofiled(names, self.profiles))
        # Timed at the sizes asked for, or (left to choose) at the defaults: the fitted costs price any other.
        requested = self.requested_batching
        rows = self.batching.micro_batch_size if requested.num_slots or requested.micro_batch_size else 32
        memory = model_memory(self.model.files, stages[0].dtype)
        config = self.config.profiling
        steps = requested.max_step_tokens or 256
        # Timed alone; the co-run probe comes after, over every stage of each machine: a stage that joined
        # stages profiled before changes what sharing costs each of them, not only itself.
        measured = collect_profiles(self.control, [s for s in stages if s.name in missing], str(self.model.path),
                                    memory, rows, steps, self.max_context, replace(config, probe_s=0),
                                    self.config.weights) if missing else []
        formats = {stage.name: stage.own_weights or self.config.weights for stage in stages}
        profiles = [replace(p, weights=formats.get(p.name, p.weights))
                    for p in profiles_of(names, self.profiles + tuple(measured))]
        if measured and config.probe_s > 0 and corun_probe:
            request = profile_request(str(self.model.path), rows, steps, self.max_context, config, self.config.weights)
            profiles = measure_sharing(self.control, stages, profiles, request, config.probe_s, config.timeout_s,
                                       rounds=config.sharing_rounds, tick_layers=tick_layers_of(memory, len(stages)))
        self.profiles = tuple(profiles)
        self.time_links(stages)
        return bool(measured)

    def chain_planner(self, stages: list[StageInfo]) -> Callable[[list[StageProfile], tuple, int], Plan]:
        """A planner of one chain over some of `stages` (profiled), beside other chains' stages, with the
        batch sizes this broker would choose for that chain (planning.one_chain_planner). Pure once made:
        it touches no socket."""
        inputs = self._plan_inputs(stages)
        return one_chain_planner(self.requested_batching, inputs.memory, inputs.options, inputs.network,
                                 self.config.workload, job_shape)

    def _heartbeating(self, compute: Callable[[], T]) -> T:
        """`compute()` (pure planning) on a thread of its own while this one keeps the stages' heartbeats
        going: planning a job of a few hundred items takes seconds (11 s for the README's command on this
        2-core machine under load), and a stage that hears nothing for its --broker-timeout (15 s) leaves.
        The control socket stays with this thread; `compute` touches no socket."""
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                outcome["value"] = compute()
            except BaseException as error:  # noqa: BLE001 - re-raised below, on the caller's thread
                outcome["error"] = error

        worker = threading.Thread(target=run, name="layerbus-planning", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(self.config.pipeline.heartbeat_interval_s / 2)
            self.control.poll(0)
            self.control.heartbeat(self.config.pipeline.heartbeat_interval_s)
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        return outcome["value"]  # type: ignore[return-value]

    def _size_batches(self, names: list[str], stages: list[StageInfo], memory) -> Plan:
        """Choose the sizes left to the broker (each candidate count of micro-batches planned, the
        fastest predicted kept: broker.batch_sizing.choose_by_plan); the plan for them."""
        def plan_for(batching: BatchingConfig) -> Plan:
            self.batching = batching
            return plan_chain(names, self.profiles, self._plan_inputs(stages))

        workload = self.config.workload
        sizing, plan = choose_by_plan(self.requested_batching, len(names), self.profiles, memory, plan_for,
                                      workload.items if workload else None, mean_decode_context(workload),
                                      self.config.plan_options.reserve_fraction)
        self.batching, self.batching_reasons = sizing.batching, sizing.reasons
        return plan

    def time_links(self, stages: list[StageInfo]) -> None:
        """Have the stages time the links between them that are not measured yet (a new stage's)."""
        if not self.config.link_probe.enabled or len(stages) < 2:
            return
        timed = probe_links(self.control, stages, self.measured_links, self.step_bytes, self.step_rows,
                            self.config.link_probe)
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

    def _plan_inputs(self, stages: list[StageInfo]) -> PlanInputs:
        dtypes = sorted({stage.dtype for stage in stages})
        if len(dtypes) > 1:
            log.warning("stages run different dtypes %s; memory is planned for %s", dtypes, stages[0].dtype)
        workload = self.config.workload
        job = job_shape(workload, self.batching) if workload is not None and workload.items else None
        network = self.link_matrix(stages)
        return PlanInputs(self.model.path.name, model_memory(self.model.files, stages[0].dtype), self.batching,
                          self.config.plan_options, job, network)

    def _assign(self, placement: Placement) -> None:
        """Choose the links' codecs, make `placement` the one in use and have its stages load it."""
        wire, auto = link_codec_inputs(self.config.wire, self.config.wire_auto, placement, self.profiles)
        codecs = plan_link_codecs(wire, len(placement.stages) - 1, self.step_bytes, self.config.model_dir, auto)
        self.placement = placement.with_codecs(codecs)
        self._placed_among = {stage.name for stage in self.control.live_stages()}
        if placement.plan is not None and self.config.plan_options.max_auto_level > 0:
            # Re-plans keep the precision this first placement chose (see PlanOptions.max_auto_level).
            quantized = {stage.weights for stage in placement.plan.stages} & set(AUTO_FALLBACKS)
            level = max((AUTO_FALLBACKS.index(name) + 1 for name in quantized), default=0)
            self.config = replace(self.config, plan_options=replace(self.config.plan_options, max_auto_level=level))
        log.info("placing %s: %s", self.model.path, self.placement.text())
        if self.tracer is not None:
            self.tracer.placed(self.placement, {stage.name: stage.host for stage in self.chain})
            began = self.tracer.now()
        self.control.assign(self.placement, str(self.model.path), self.results_address, self.batching.num_slots,
                            self.max_context, self.config.load_timeout_s,
                            liveness_window_s=self.config.pipeline.liveness_window_s,
                            weights=stage_weights(self.placement, self.config.weights),
                            keep_caches=self.batching.keep_caches, context_hint=self._context_hint())
        if self.tracer is not None:
            self.tracer.span("load spans", PLACE, began, self.tracer.now(), chain=self.placement.text())

    def start(self) -> None:
        """Wait for the stages, give each its span, wait until all have loaded.

        Where the broker started the stage processes (control.children), one that ends before it has
        loaded its span is left out and the model placed again, once it has been restarted and registered
        again or given up on; what happened is in `start_events`. Elsewhere a lost stage fails the start.
        """
        deadline = self.control.clock() + self.config.register_timeout_s
        while True:
            stages = self.control.wait_for_stages(self.config.num_stages, deadline - self.control.clock(),
                                                  self.config.pipeline.heartbeat_interval_s)
            try:
                self._assign(self._place(stages))
                break
            except ClusterError as error:  # StageLost included: died while loading, or left while profiled
                lost = lost_in_start(error, stages)
                if self.control.children is None or lost is None:
                    raise
                self._forget(lost)
                self.counts.stages_lost += 1
                self._note_exits()
                reason = error.reason if isinstance(error, StageLost) else lost.error or str(error)
                self.start_events.append(("stage_lost", f"stage {lost.name} lost while the model was being placed "
                                          f"({reason}); placing it again"))
                log.warning("%s", self.start_events[-1][1])
        self._note_exits()
        if self.start_events and len(self.chain) < self.config.num_stages:
            self.start_events.append(("placed_fewer", f"placed over {len(self.chain)} of {self.config.num_stages} "
                                      f"stages: {self.control.stages_missing() or 'the plan left some out'}"))
            log.warning("%s", self.start_events[-1][1])
        self.pipeline = Pipeline(self.context, self.control, lambda: self.placement, self.results, self.batching,
                                 set(self.model.eos_ids), self._new_detokenizer, self.config.pipeline,
                                 recover=self.recover, rebalance=self.rebalance, grow=self.grow,
                                 expected=self._expected_busy_s,
                                 tracer=self.tracer, counts=self.counts, new_grammar=self._new_grammar)

    # -- re-planning -----------------------------------------------------------------------------
    def _note_exits(self) -> None:
        """Turn the stage processes that ended since the last call into start events."""
        for ended in self.control.exits[self._exits_noted:]:
            then = f"restarted ({ended.restarts} of at most {self.control.children.max_restarts})" \
                if ended.restarted else "not restarted: going on without it"
            self.start_events.append(("stage_exited", f"stage {ended.name} (pid {ended.pid}) {ended.why}; {then}"))
        self._exits_noted = len(self.control.exits)

    def _forget(self, stage: StageInfo) -> None:
        """A lost stage serves no more; if it registers again it is measured anew."""
        self.control.mark_lost(stage)
        self._placed_among.discard(stage.name)  # back under its name later, it is a stage that joins
        before = {p.name: p.corun_factor for p in self.profiles}
        self.profiles = without_stage(self.profiles, stage.name)
        dropped = sorted(p.name for p in self.profiles if p.corun_factor != before[p.name])
        if dropped:
            log.info("co-run factors of %s dropped: measured beside %s; the plan reckons their sharing from "
                     "threads and cores", ", ".join(dropped), stage.name)
        self.measured_links = {pair: link for pair, link in self.measured_links.items() if stage.name not in pair}

    def recover(self, lost: StageLost, should_stop=lambda: False, report=lambda *a, **k: None) -> Placement | None:
        """Re-plan over the stages still alive (spares and stages that registered since included),
        load the new spans, and return the new placement. While they cannot hold the model (none
        left, or too little memory), wait for a stage to register. Another stage lost while loading
        is dropped too, and the plan made again. None when `should_stop` says so."""
        self._forget(lost.stage)
        self.counts.stages_lost += 1
        waiting_for: str | None = None
        timed_before = self.links_timed
        while not should_stop():
            candidates = [s for s in self.control.live_stages() if s.state is not StageState.FAILED]
            try:
                if not candidates:
                    raise PlacementError("no stage is left")
                placement = self._place(candidates)
            except PlacementError as why:
                reason = (f"the stages left cannot hold {self.model.path.name} ({why}); waiting for a stage to "
                          f"register at {self.address} (`layerbus stage --broker {self.address}`)")
                if reason != waiting_for:
                    report("waiting", reason)
                    waiting_for = reason
                self._wait_for_registration(should_stop)
                continue
            try:
                self._assign(placement)
                self.counts.replans_lost += 1
                if self.links_timed > timed_before:  # a stage joined: its links were timed for this plan
                    report("links", self.link_matrix_report())
                return self.placement
            except StageLost as again:
                self._forget(again.stage)
                self.counts.stages_lost += 1
                report("stage_lost", f"{again} (while loading a new span)", stage=again.stage.name)
            except ClusterError as error:  # a load failed: that stage is left out of the next plan
                report("load_failed", str(error))
        return None

    def _wait_for_registration(self, should_stop) -> None:
        known = len(self.control.stages)
        while len(self.control.stages) == known and not should_stop():
            self.control.poll(200)
            self.control.heartbeat(self.config.pipeline.heartbeat_interval_s)

    def _expected_busy_s(self, stage_name: str, work: Work) -> float:
        """For the drift watch: the profile's price of `work` on this stage (0 without a plan)."""
        return expected_busy_s(self.plan, self.profiles, stage_name, work)

    def rebalance(self, slowed: dict[str, float], report=lambda *a, **k: None) -> Placement | None:
        """A stage runs `factor` times slower than it did: plan again with its profile slowed as much,
        and move layers if the new plan is at least `drift.min_gain` faster than the placement in use
        (re-loading spans and re-prefilling cost something). Returns the new placement, or None."""
        if self.plan is None:  # "balanced" and "equal" have no measured profiles to re-plan from
            return None
        decision = replan_slowed(slowed, self.placement, [s.name for s in self.control.live_stages()],
                                 self.profiles, self._plan_inputs(self.chain), self.config.pipeline.drift.min_gain)
        self.profiles = decision.profiles
        if decision.best is not None:
            log.info("slowed %s: placement in use %.1f ms per step, best plan %.1f ms (%.0f%% faster)",
                     slowed, decision.current_step_s * 1e3, decision.best.step_s * 1e3, decision.gain * 100)
        if decision.plan is None:
            return None
        for line in format_plan(decision.plan).splitlines():
            log.info("%s", line)
        self._assign_mid_run(planned(decision.plan), blamed=None)
        self.counts.replans_slowed += 1
        return self.placement

    def _assign_mid_run(self, placement: Placement, blamed: StageInfo | None) -> None:
        """Load a re-plan while the job runs. A stage that cannot load its new span is reported lost (the
        failed one, else `blamed`, else the chain's first), so the pipeline re-plans without it."""
        try:
            self._assign(placement)
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
                if stage.name not in self._placed_among and stage.state is StageState.SPARE]

    def grow(self, report=lambda *a, **k: None) -> Placement | None:
        """Put stages that joined mid-job to work: with --partition planned, profile them (alone) and move to
        the best plan over every live stage if it is at least `drift.min_gain` faster than the placement in
        use (re-loading spans and re-prefilling cost something), else they stay spares, ready for the next
        re-plan; with equal or balanced the user asked for every stage, so the split is made again over all.
        Returns the new placement, loaded and ready, or None (nothing joined, or nothing faster)."""
        joined = self.joined_stages()
        if not joined:
            return None
        names = ", ".join(stage.name for stage in joined)
        self._placed_among.update(stage.name for stage in joined)  # considered once: no re-plan per loop
        live = [stage for stage in self.control.live_stages() if stage.state is not StageState.FAILED]
        if self.config.partition == "planned":
            try:  # the job waits meanwhile: a few seconds, or a cached profile's fraction of one
                self.profile(live, corun_probe=False)
            except StageLost:
                raise  # one of the chain's: the pipeline re-plans without it
            except ClusterError as error:  # the newcomer's own failure is no reason to stop the job
                report("joined", f"{names} registered mid-job but could not be profiled ({error}): left out")
                return None
            min_gain = self.config.pipeline.drift.min_gain
            decision = replan_slowed({}, self.placement, [stage.name for stage in live], self.profiles,
                                     self._plan_inputs(live), min_gain)
            if decision.plan is None:
                best = f"{decision.best.step_s * 1e3:.1f} ms per step" if decision.best is not None else "none fits"
                report("joined", f"{names} registered mid-job; the best plan with it ({best}) is not at least "
                                 f"{min_gain:.0%} faster than the placement in use ({decision.current_step_s * 1e3:.1f} "
                                 f"ms): kept as a spare for the next re-plan")
                return None
            for line in format_plan(decision.plan).splitlines():
                log.info("%s", line)
            placement = planned(decision.plan)
        else:
            placement = self._place(live)
        self._assign_mid_run(placement, blamed=joined[0])
        self.counts.replans_joined += 1
        return self.placement

    def _write_trace(self) -> None:
        """On the way out (end, Ctrl-C, failure): ask the stages still there for their last records
        (briefly: they may be gone), then write what there is. Never stops the closing."""
        try:
            self.tracer.collect(self.control, self.chain, timeout_s=2.0)
            self.tracer.write()
        except Exception:  # noqa: BLE001
            log.exception("trace: could not write %s", self.tracer.path)

    # -- serving ---------------------------------------------------------------------------------
    def _new_detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer())

    def _new_grammar(self, constraint: Constraint) -> TokenGrammar:
        if self._grammars is None:
            # Imported here: jobs without constraints never load the grammar engine.
            from layerbus.broker.grammar import GrammarCompiler

            vocab_size = int(getattr(self.model.files.config, "vocab_size", 0) or len(self.tokenizer()))
            self._grammars = GrammarCompiler(self.config.model_dir, set(self.model.eos_ids), vocab_size)
        return self._grammars.new(constraint)

    def run(self, source: RequestSource, sink: ResultSink, should_stop=lambda: False, events=None) -> RunStats:
        if self.pipeline is None:
            raise ClusterError("the broker has not started: call start() first")
        before = {s.name: dict(s.stats) for s in self.chain}
        source, sink = RecordingSource(source), RecordingSink(sink)
        stats = self.pipeline.run(source, sink, should_stop, events)
        if self.tracer is not None:
            self.tracer.write()
        if self.plan is not None and not stats.recoveries:  # after a re-plan the stats span two plans
            self.last_prediction = self._prediction_report(before, stats, source, sink, events)
        return stats

    def _context_hint(self) -> int:
        """The positions the job's longest item can reach (0: no job known): the stages make their KV caches
        that long at load. Grown by doubling mid-job instead, a 64-slot cache of 15 layers took 4-5 s to
        reach 1,024 positions on this 2-core machine (allocating, zeroing and copying 1.5 GB), and every
        stage behind it waited: 10% of a 90 s run."""
        workload = self.config.workload
        return min(workload.longest_sequence, self.max_context) if workload is not None else 0

    def _prediction_report(self, before: dict, stats: RunStats, source: "RecordingSource",
                           sink: "RecordingSink", events=None) -> dict:
        """Log predicted against measured, per stage, one table line each, and tell `events` the same table
        (the job's "predicted" event, which `layerbus status JOB` shows); the report as a dict too (on the
        summary line's record as `prediction`, for benchmarks)."""
        produced = None
        lengths = sink.output_lengths(source.request_ids)
        if lengths is not None and self.config.workload is not None and len(lengths) == self.config.workload.items:
            # The plan's cost model again, now told where outputs really ended: what is left of the
            # difference is the cost model's, not the guess of the output lengths.
            plan = self.plan
            job = job_shape(self.config.workload.with_output_lengths(lengths), self.batching)
            inputs = self._plan_inputs(self.chain)
            produced = estimate_split([p for name in plan.order for p in self.profiles if p.name == name],
                                      plan.spans, inputs.memory, self.batching, plan.options, job, inputs.network)
        report = prediction_report(self.plan, before, stats.stage_stats, stats.new_tokens, stats.wall_s, produced)
        lines = format_prediction(report)
        for line in lines[:-1]:
            log.info("%s", line)
        log.info("%s", lines[-1], extra={"prediction": report})
        if events is not None:
            events("predicted", "\n".join(lines))
        return report

    def keep_alive(self, seconds: float, report=lambda *a, **k: None, should_stop=lambda: False) -> None:
        """Between jobs: keep heartbeats going and re-plan when a stage is lost (the next run follows). While
        the stages left cannot hold the model it waits for one to register, until `should_stop` says so:
        then it returns early, the lost stage still in the placement (found lost again on the next call)."""
        deadline = self.control.clock() + seconds
        while self.control.clock() < deadline:
            self.control.poll(100)
            self.control.heartbeat(self.config.pipeline.heartbeat_interval_s)
            try:
                self.control.check_stages(self.chain, self.config.pipeline.liveness_window_s,
                                          self.config.pipeline.stuck_step_s)
            except StageLost as lost:
                report("stage_lost", str(lost), stage=lost.stage.name)
                started = self.control.clock()
                if self.recover(lost, should_stop=should_stop, report=report) is None:
                    return
                report("recovered", f"re-planned without {lost.stage.name} between runs: {self.placement.text()}",
                       stage=lost.stage.name, duration_s=self.control.clock() - started)

    def generate(self, requests: list[GenerationRequest]) -> tuple[list[GenerationResult], RunStats]:
        """Run requests to the end; results come back in request order."""
        collected: dict[str, GenerationResult] = {}

        class _Collect:
            def deliver(self, results: list[GenerationResult]) -> None:
                collected.update((r.request_id, r) for r in results)

        stats = self.run(ListSource(requests), _Collect())
        return [collected[r.request_id] for r in requests], stats

    def close(self) -> None:
        if self.tracer is not None:
            self._write_trace()
        self.control.shutdown_all()
        if self.pipeline is not None:
            self.pipeline.close()
        self.results.close(linger=0)
        self.control.close()
        if self._own_context:
            self.context.term()



def lost_in_start(error: ClusterError, stages: list[StageInfo]) -> StageInfo | None:
    """The stage whose loss `error` is while starting (StageLost's, or one of `stages` gone), else None."""
    if isinstance(error, StageLost):
        return error.stage
    return next((stage for stage in stages if not stage.state.alive), None)
