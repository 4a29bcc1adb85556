"""The broker: owns the control plane, the result socket, the schedule and the placement in use, and serves
runs of requests over its chain of stages.

Who serves which layers is the ChainKeeper's (broker/chain_keeper.py: measuring, planning, loading) and how
the chain is re-planned mid-job is the Replanner's (broker/replanning.py); the data-plane loop is the
Pipeline's (broker/pipeline.py). The control socket is served on a thread of its own from the moment it is
bound (broker/control_io.py), so stages that register are answered whatever the broker is doing: a caller
may bind it first (`open_control`) and prepare the model after, as `layerbus broker` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import zmq

from layerbus.broker.chain_keeper import PARTITIONS, ChainKeeper, KeeperConfig
from layerbus.broker.control import ClusterError, ControlPlane, StageInfo, StageLost
from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.broker.link_probing import LinkProbeConfig
from layerbus.broker.pipeline import Pipeline, PipelineConfig
from layerbus.broker.prediction import prediction_of_run
from layerbus.broker.profiling import ProfilingConfig
from layerbus.broker.replanning import Replanner
from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.broker.run_state import BrokerCounts, ListSource, RecordingSink, RecordingSource, RequestSource, ResultSink, RunStats
from layerbus.broker.stage_view import StageView
from layerbus.broker.trace_file import BrokerTrace
from layerbus.broker.waits import Liveness, NoReply
from layerbus.models.model_info import ModelInfo, load_tokenizer, read_model_info
from layerbus.planner.batch_sizing import choose_batching
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.chain import Placement
from layerbus.planner.network import HostLinks
from layerbus.planner.placement import Plan, PlanOptions, StageProfile
from layerbus.planner.wire_choice import AutoWireInputs, plan_link_codecs
from layerbus.planner.workload import Workload
from layerbus.storage.snapshot_records import StageSnapshot
from layerbus.wire.constraint import Constraint
from layerbus.wire.curve import ClusterKeys
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import check_weight_format

if TYPE_CHECKING:
    from layerbus.broker.grammar import TokenGrammar
    from layerbus.broker.link_probing import MeasuredLink

log = logging.getLogger("layerbus.broker")
__all__ = ["PARTITIONS", "Broker", "BrokerConfig", "open_control"]


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
    # The job to plan for (planner.workload.Workload: its prompt lengths and output budgets): the plan
    # prices its prefill, decode and drain, and batch sizes left at 0 are chosen for it. None: a
    # steady mix (plan_options.prompt_tokens_per_new_token), as for a broker serving whatever comes.
    workload: Workload | None = None
    # What the links between hosts cost (planner.network.HostLinks, as a network file's [[links]] and
    # [network] give them): every plan prices each send by the link it crosses. A stage runs on the host
    # it registered with unless `hosts` names it. Over the pairs it covers it wins against the stages'
    # measured links (`link_probe`). None: the measured links, else each stage's own profiled link.
    network: HostLinks | None = None
    # The stages time the links between them once registered and profiled (broker.link_probing); a
    # planned partition prices each send by the link it crosses. enabled=False: each stage's own link.
    link_probe: LinkProbeConfig = field(default_factory=LinkProbeConfig)


def open_control(keys: ClusterKeys | None, bind: str, heartbeat_interval_s: float = 0.5,
                 context: zmq.Context | None = None) -> ControlPlane:
    """Bind the broker's control socket and start answering stages, before anything else is ready: a
    stage that registers hears what the broker is busy with (ControlPlane.phase). A secured broker has a
    context of its own: libzmq takes one ZAP authenticator per context. ZMQError when the bind fails."""
    own = context is None and keys is not None
    context = context or (zmq.Context() if own else zmq.Context.instance())
    try:
        control = ControlPlane(context, bind, keys=keys, heartbeat_interval_s=heartbeat_interval_s)
    except zmq.ZMQError:
        if own:
            context.term()
        raise
    control.owns_context = own
    return control


class Broker:
    def __init__(self, config: BrokerConfig, context: zmq.Context | None = None, control: ControlPlane | None = None):
        if config.partition not in PARTITIONS:
            raise ValueError(f"partition {config.partition!r} is not one of {', '.join(PARTITIONS)}")
        check_weight_format(config.weights)
        self.config = config
        self.model: ModelInfo = read_model_info(config.model_dir)
        if config.num_stages > self.model.files.num_layers:
            raise ValueError(f"{config.num_stages} stages for a model of {self.model.files.num_layers} layers: "
                             "every stage needs at least one layer; use fewer stages")
        self.max_context = min(config.batching.max_context, self.model.max_positions)
        requested = replace(config.batching, max_context=self.max_context)
        # Sizes left at 0 are chosen from the profiles when the model is placed ("planned"); until then,
        # and for the other partitions, from the job alone (no more slots than items).
        sizing = choose_batching(requested, config.num_stages, (), None,
                                 config.workload.items if config.workload else None)
        # Decode steps dominate a run's hops: a micro-batch's rows of float32 hidden states.
        step_rows = max(1, sizing.batching.num_slots // max(1, sizing.batching.num_micro_batches))
        step_bytes = step_rows * self.model.files.config.hidden_size * 4
        # Checked now, so a bad --wire is a usage error before any stage starts; chosen again per chain.
        plan_link_codecs(config.wire, config.num_stages - 1, step_bytes, config.model_dir, config.wire_auto)
        self.control = control or open_control(config.keys, config.control_bind,
                                                config.pipeline.heartbeat_interval_s, context)
        self.context = self.control.io.context
        self.results = self.context.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        if self.control.gate is not None:
            self.control.gate.guard(self.results)
        try:
            self.results.bind(config.results_bind)
        except zmq.ZMQError:
            self.results.close(linger=0)
            self._close_control()
            raise
        self.results_address = self._advertised(self.results.getsockopt(zmq.LAST_ENDPOINT).decode())
        self.pipeline: Pipeline | None = None
        self._tokenizer = None
        self._grammars = None  # broker.grammar.GrammarCompiler, built at the first constrained request
        self.tracer = BrokerTrace(config.trace) if config.trace else None
        self.control.tracer = self.tracer
        self.last_prediction: dict | None = None  # the last run's predicted against measured (broker.prediction)
        # (kind, message) of what went wrong while starting (a stage process ended, a stage lost while
        # loading), for the job's events: the job is not known yet when the broker starts.
        self.start_events: list[tuple[str, str]] = []
        self._exits_noted = 0
        self._stage_view = StageView()  # the stages' load between calls of stage_snapshots
        self.counts = BrokerCounts()  # stages lost, re-plans, failed and resent steps: the metrics' counters
        liveness = Liveness(config.pipeline.liveness_window_s, config.profiling.timeout_s)
        keeper_config = KeeperConfig(config.partition, config.plan_options, config.profiling, config.link_probe,
                                     liveness, config.pipeline.drift.min_gain, config.load_timeout_s, config.wire,
                                     config.wire_auto, config.weights, config.workload, config.network)
        self.keeper = ChainKeeper(keeper_config, self.model, self.control, requested, sizing.batching,
                                  sizing.reasons, self.results_address, step_bytes, step_rows, self.counts, self.tracer)
        self.replanner = Replanner(self.keeper, self._context_hint)

    # -- the placement in use, read-only views -------------------------------------------------
    @property
    def placement(self) -> Placement | None:
        """The chain in use; replaced whole, never changed in place."""
        return self.keeper.placement

    @property
    def chain(self) -> list[StageInfo]:
        """The stages of the placement in use, in chain order (their live state)."""
        return self.keeper.chain

    @property
    def spans(self) -> list[LayerRange]:
        return list(self.placement.spans) if self.placement else []

    @property
    def plan(self) -> Plan | None:
        """The planner's figures for the placement in use ("planned"), or None."""
        return self.keeper.plan

    @property
    def link_codecs(self) -> list[str]:
        return list(self.placement.codecs) if self.placement else []

    @property
    def profiles(self) -> tuple[StageProfile, ...]:
        """Every registered stage's profile ("planned"), for re-planning."""
        return self.keeper.profiles

    @profiles.setter
    def profiles(self, profiles: tuple[StageProfile, ...]) -> None:
        self.keeper.profiles = tuple(profiles)

    @property
    def measured_links(self) -> dict[tuple[str, str], MeasuredLink]:
        return self.keeper.measured_links

    @property
    def batching(self) -> BatchingConfig:
        """The batch sizes in use (chosen with the first profiles where left to the broker)."""
        return self.keeper.batching

    @property
    def requested_batching(self) -> BatchingConfig:
        return self.keeper.requested_batching

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

    # -- measuring and placing (the keeper's) -----------------------------------------------------
    def profile(self, stages: list[StageInfo], corun_probe: bool = True) -> bool:
        return self.keeper.profile(stages, corun_probe)

    def time_links(self, stages: list[StageInfo]) -> None:
        self.keeper.time_links(stages)

    def link_matrix(self, stages: list[StageInfo] | None = None):
        return self.keeper.link_matrix(stages)

    def link_matrix_report(self) -> str:
        return self.keeper.link_matrix_report()

    def chain_planner(self, stages: list[StageInfo]):
        return self.keeper.chain_planner(stages)

    def recover(self, lost: StageLost, should_stop=lambda: False, report=lambda *a, **k: None) -> Placement | None:
        return self.replanner.recover(lost, should_stop, report)

    def start(self) -> None:
        """Wait for the stages, give each its span, wait until all have loaded.

        A stage that ends, falls silent or cannot be measured before it has loaded its span is left out and
        the model placed again, once enough stages are there (where the broker started the stage processes
        itself, control.children, after it was restarted or given up on); what happened is in `start_events`.
        """
        deadline = self.control.clock() + self.config.register_timeout_s
        while True:
            self.control.phase = f"waiting for {self.config.num_stages} stage(s) to register"
            stages = self.control.wait_for_stages(self.config.num_stages, deadline - self.control.clock())
            try:
                self.keeper.assign(self.keeper.place(stages, watch=self._watching(stages)), self._context_hint())
                break
            except ClusterError as error:  # StageLost, NoReply included: died or failed while measured or loading
                lost = lost_in_start(error, stages)
                if lost is None:
                    raise
                self.replanner.drop(lost)
                self._note_exits()
                reason = error.reason if isinstance(error, (StageLost, NoReply)) else lost.error or str(error)
                self.start_events.append(("stage_lost", f"stage {lost.name} lost while the model was being placed "
                                          f"({reason}); placing it again"))
                log.warning("%s", self.start_events[-1][1])
        self.control.phase = None
        self._note_exits()
        if self.start_events and len(self.chain) < self.config.num_stages:
            self.start_events.append(("placed_fewer", f"placed over {len(self.chain)} of {self.config.num_stages} "
                                      f"stages: {self.control.stages_missing() or 'the plan left some out'}"))
            log.warning("%s", self.start_events[-1][1])
        self.pipeline = Pipeline(self.context, self.control, lambda: self.placement, self.results, self.batching,
                                 set(self.model.eos_ids), self._new_detokenizer, self.config.pipeline,
                                 replanner=self.replanner, tracer=self.tracer, counts=self.counts,
                                 new_grammar=self._new_grammar)

    def _watching(self, stages: list[StageInfo]):
        """While one stage is measured, another of `stages` that dies or falls silent raises StageLost."""
        window = self.config.pipeline.liveness_window_s
        return lambda: self.control.check_stages([s for s in stages if s.state.alive], window,
                                                 self.config.profiling.timeout_s)

    def _note_exits(self) -> None:
        """Turn the stage processes that ended since the last call into start events."""
        for ended in self.control.exits[self._exits_noted:]:
            then = f"restarted ({ended.restarts} of at most {self.control.children.max_restarts})" \
                if ended.restarted else "not restarted: going on without it"
            self.start_events.append(("stage_exited", f"stage {ended.name} (pid {ended.pid}) {ended.why}; {then}"))
        self._exits_noted = len(self.control.exits)

    def _context_hint(self) -> int:
        """The positions the job's longest item can reach (0: no job known): the stages make their KV caches
        that long at load. Grown by doubling mid-job instead, a 64-slot cache of 15 layers took 4-5 s to
        reach 1,024 positions on a 2-core machine (allocating, zeroing and copying 1.5 GB), and every
        stage behind it waited."""
        workload = self.config.workload
        return min(workload.longest_sequence, self.max_context) if workload is not None else 0

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
            self.last_prediction = prediction_of_run(self.keeper, self.config.workload, before, stats,
                                                     source, sink, events)
        return stats

    def keep_alive(self, seconds: float, report=lambda *a, **k: None, should_stop=lambda: False) -> None:
        """Between jobs: keep judging the stages and re-plan when one is lost (the next run follows). While the
        stages left cannot hold the model it waits for one to register, until `should_stop` says so."""
        pipeline = self.config.pipeline
        self.replanner.keep_alive(seconds, pipeline.liveness_window_s, pipeline.stuck_step_s, report, should_stop)

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
        self.keeper.close()
        self.results.close(linger=0)
        self._close_control()

    def _close_control(self) -> None:
        if self.control.closed:
            return
        self.control.close()
        if self.control.owns_context:
            self.context.term()


def lost_in_start(error: ClusterError, stages: list[StageInfo]) -> StageInfo | None:
    """The stage whose loss `error` is while starting (StageLost's or NoReply's, or one of `stages` gone),
    else None."""
    if isinstance(error, (StageLost, NoReply)):
        return error.stage
    return next((stage for stage in stages if not stage.state.alive), None)
