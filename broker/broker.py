"""The broker: owns the control plane, the chain of stages, the schedule and the result socket."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import zmq

from layerbus.broker.control import ClusterError, ControlPlane, StageInfo, StageLost
from layerbus.broker.partition import balanced_partition, equal_partition, model_cost_from_config
from layerbus.broker.placement import Plan, PlanOptions, StageProfile
from layerbus.broker.profiling import ProfilingConfig
from layerbus.broker.pipeline import ListSource, Pipeline, PipelineConfig, RequestSource, ResultSink, RunStats
from layerbus.broker.requests import GenerationRequest, GenerationResult
from layerbus.broker.scheduler import BatchingConfig
from layerbus.broker.wire_choice import AutoWireInputs, plan_link_codecs
from layerbus.models.model_info import ModelInfo, load_tokenizer, read_model_info
from layerbus.wire.spans import LayerRange

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
    partition: str = "planned"  # "planned" (profiled stages, broker.placement), "balanced" (by FLOPs) or "equal"
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


class Broker:
    def __init__(self, config: BrokerConfig, context: zmq.Context | None = None):
        if config.partition not in PARTITIONS:
            raise ValueError(f"partition {config.partition!r} is not one of {', '.join(PARTITIONS)}")
        self.config = config
        self.model: ModelInfo = read_model_info(config.model_dir)
        if config.num_stages > self.model.files.num_layers:
            raise ValueError(f"{config.num_stages} stages for a model of {self.model.files.num_layers} layers: "
                             "every stage needs at least one layer; use fewer stages")
        self.max_context = min(config.batching.max_context, self.model.max_positions)
        self.batching = replace(config.batching, max_context=self.max_context).resolved(config.num_stages)
        self.context = context or zmq.Context.instance()
        self.control = ControlPlane(self.context, config.control_bind)
        self.results = self.context.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(config.results_bind)
        self.results_address = self._advertised(self.results.getsockopt(zmq.LAST_ENDPOINT).decode())
        # Decode steps dominate a run's hops: a micro-batch's rows of float32 hidden states.
        rows = max(1, self.batching.num_slots // max(1, self.batching.num_micro_batches))
        step_bytes = rows * self.model.files.config.hidden_size * 4
        self.step_bytes = step_bytes
        # Checked now, so a bad --wire is a usage error before any stage starts; chosen again per chain.
        self.link_codecs = plan_link_codecs(config.wire, config.num_stages - 1, step_bytes, config.model_dir,
                                            config.wire_auto)
        self.chain: list[StageInfo] = []
        self.spans: list[LayerRange] = []
        self.plan: Plan | None = None  # the placement in use ("planned"), with its predicted step times
        self.profiles: list[StageProfile] = []  # every registered stage's profile ("planned"), for re-planning
        self.pipeline: Pipeline | None = None
        self._tokenizer = None

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

    def plan_spans(self, num_stages: int | None = None) -> list[LayerRange]:
        """The "balanced" or "equal" split over `num_stages` (default: the configured count)."""
        n, p = self.model.files.num_layers, num_stages or self.config.num_stages
        if self.config.partition == "equal":
            return equal_partition(n, p)
        return balanced_partition(model_cost_from_config(self.model.files.config), p)

    def plan_chain(self, stages: list[StageInfo]) -> tuple[list[StageInfo], list[LayerRange]]:
        """The chain (which stages, in which order) and each one's span. "planned" profiles the stages
        it has no profile of yet and may leave some out (they stay registered, as spares); it raises
        PlacementError when the stages cannot hold the model."""
        stages = sorted(stages, key=lambda s: s.name)  # a stable chain order for reproducible logs
        if self.config.partition == "planned":
            from layerbus.broker.planned_start import plan_chain

            self.profiles, self.plan, chain = plan_chain(self, stages, self.profiles)
            return chain, self.plan.spans
        chain = stages[:self.model.files.num_layers]
        return chain, self.plan_spans(len(chain))

    def start(self) -> None:
        """Wait for the stages, give each its span, wait until all have loaded."""
        stages = self.control.wait_for_stages(self.config.num_stages, self.config.register_timeout_s)
        self.chain, self.spans = self.plan_chain(stages)
        self._assign()
        self.pipeline = Pipeline(self.context, self.control, self.chain, self.results, self.batching,
                                 set(self.model.eos_ids), self._detokenize, self.config.pipeline,
                                 recover=self.recover, rebalance=self.rebalance, expected=self._expected_busy_s)

    def _assign(self) -> None:
        log.info("placing %s: %s", self.model.path, ", ".join(f"{s.name} {span}" for s, span in zip(self.chain, self.spans)))
        self.link_codecs = self._plan_link_codecs()
        if self.link_codecs:
            log.info("wire: %s", self.wire_summary())
        self.control.assign(self.chain, self.spans, str(self.model.path), self.results_address,
                            self.batching.num_slots, self.max_context, self.config.load_timeout_s,
                            self.link_codecs, liveness_window_s=self.config.pipeline.liveness_window_s)

    def recover(self, lost: StageLost, should_stop=lambda: False, report=lambda *a, **k: None) -> list[StageInfo] | None:
        """Re-plan over the stages still alive (spares and stages that registered since included),
        load the new spans, and return the new chain. While they cannot hold the model (none left, or
        too little memory), wait for a stage to register. Another stage lost while loading is dropped
        too, and the plan made again. None when `should_stop` says so."""
        from layerbus.broker.placement import PlacementError

        self.control.mark_lost(lost.stage)
        self.profiles = [p for p in self.profiles if p.name != lost.stage.name]  # a re-registered one is measured anew
        waiting_for: str | None = None
        while not should_stop():
            candidates = [s for s in self.control.live_stages() if s.state != "failed"]
            try:
                if not candidates:
                    raise PlacementError("no stage is left")
                self.chain, self.spans = self.plan_chain(candidates)
            except PlacementError as why:
                reason = (f"the stages left cannot hold {self.model.path.name} ({why}); waiting for a stage to "
                          f"register at {self.address} (`layerbus stage --broker {self.address}`)")
                if reason != waiting_for:
                    report("waiting", reason)
                    waiting_for = reason
                known = len(self.control.stages)
                while len(self.control.stages) == known and not should_stop():  # until someone registers
                    self.control.poll(200)
                    self.control.heartbeat(self.config.pipeline.heartbeat_interval_s)
                continue
            try:
                self._assign()
                return self.chain
            except StageLost as again:
                self.control.mark_lost(again.stage)
                self.profiles = [p for p in self.profiles if p.name != again.stage.name]
                report("stage_lost", f"{again} (while loading a new span)", stage=again.stage.name)
            except ClusterError as error:  # a load failed: that stage is left out of the next plan
                report("load_failed", str(error))
        return None

    def _expected_busy_s(self, stage_name: str, work) -> float:
        """For the drift watch: the profile's price of `work` on this stage (0 without a plan)."""
        from layerbus.broker.planned_start import expected_busy_s

        return expected_busy_s(self, stage_name, work)

    def rebalance(self, slowed: dict[str, float], report=lambda *a, **k: None) -> list[StageInfo] | None:
        """A stage runs `factor` times slower than it did: plan again with its profile slowed as much,
        and move layers if the new plan is at least `drift.min_gain` faster than the placement in use
        (re-loading spans and re-prefilling cost something). Returns the new chain, or None."""
        if self.plan is None:  # "balanced" and "equal" have no measured profiles to re-plan from
            return None
        from layerbus.broker.planned_start import replan_slowed

        plan = replan_slowed(self, slowed)
        if plan is None:
            return None
        by_name = {stage.name: stage for stage in self.control.live_stages()}
        self.plan, self.chain, self.spans = plan, [by_name[name] for name in plan.order], plan.spans
        try:
            self._assign()
        except StageLost:
            raise
        except ClusterError as error:  # a stage could not load its new span: re-plan without it
            failed = next((stage for stage in self.chain if stage.state == "failed"), self.chain[0])
            raise StageLost(failed, f"could not load its new span: {error}") from None
        return self.chain

    def _plan_link_codecs(self) -> list[str]:
        """The codec of each link of the chain in use. A per-link list given for the configured chain
        is cut (or its last codec repeated) when a plan uses fewer or more stages; `auto` takes each
        link's bandwidth and the step time from the profiles when they were measured."""
        links = len(self.chain) - 1
        wire, auto = self.config.wire, self.config.wire_auto
        if not isinstance(wire, str) and len(wire) != links:
            wire = tuple(wire[i] if i < len(wire) else wire[-1] for i in range(links))
        if self.plan is not None:
            by_name = {profile.name: profile for profile in self.profiles}
            if not auto.link_bandwidth and all(s.name in by_name for s in self.chain):
                auto = replace(auto, link_bandwidth=tuple(by_name[s.name].link_bandwidth for s in self.chain[:-1]))
            if auto.compute_s_per_step is None:
                auto = replace(auto, compute_s_per_step=max(p.compute_s for p in self.plan.chosen.stages))
        return plan_link_codecs(wire, links, self.step_bytes, self.config.model_dir, auto)

    def wire_summary(self) -> str:
        """The codec of each link, e.g. "stage-0 -> stage-1 int8, stage-1 -> stage-2 float16"."""
        names = [s.name for s in self.chain] or [f"stage {i}" for i in range(self.config.num_stages)]
        return ", ".join(f"{a} -> {b} {codec}" for a, b, codec in zip(names, names[1:], self.link_codecs))

    def placement_summary(self) -> str:
        """The chain in one line, e.g. "stage-1 [0, 24) -int8-> stage-0 [24, 30)" (for the job's events)."""
        parts = []
        for i, (stage, span) in enumerate(zip(self.chain, self.spans)):
            parts.append(f"{stage.name} {span}")
            if i < len(self.chain) - 1:
                codec = self.link_codecs[i] if i < len(self.link_codecs) else "float32"
                parts.append(f"-{codec}->")
        planned = f"; predicted {self.plan.tokens_per_s:.1f} tok/s" if self.plan is not None else ""
        return " ".join(parts) + f" ({self.config.partition}{planned})"

    def run_info(self) -> dict:
        """For storage.run_info: the chain, its spans and the codec of each link."""
        names = [s.name for s in self.chain]
        return {"stages": [{"name": s.name, "layers": str(span)} for s, span in zip(self.chain, self.spans)],
                "wire": [{"from": a, "to": b, "codec": codec}
                         for a, b, codec in zip(names, names[1:], self.link_codecs)]}

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer().decode(token_ids, skip_special_tokens=True)

    def run(self, source: RequestSource, sink: ResultSink, should_stop=lambda: False, events=None) -> RunStats:
        if self.pipeline is None:
            raise ClusterError("the broker has not started: call start() first")
        before = {s.name: dict(s.stats) for s in self.chain}
        stats = self.pipeline.run(source, sink, should_stop, events)
        if self.plan is not None and not stats.recoveries:  # after a re-plan the stats span two plans
            from layerbus.broker.plan_report import step_time_report

            for line in step_time_report(self.plan, before, stats.stage_stats):
                log.info("%s", line)
        return stats

    def keep_alive(self, seconds: float, report=lambda *a, **k: None) -> None:
        """Between jobs: keep heartbeats going and re-plan when a stage is lost."""
        deadline = self.control.clock() + seconds
        while self.control.clock() < deadline:
            self.control.poll(100)
            self.control.heartbeat(self.config.pipeline.heartbeat_interval_s)
            try:
                gone = next((s for s in self.chain if s.state == "gone"), None)
                if gone is not None:
                    raise StageLost(gone, "it left (stopped or shut down)")
                self.control.check_liveness(self.chain, self.config.pipeline.liveness_window_s,
                                            self.config.pipeline.stuck_step_s)
            except StageLost as lost:
                report("stage_lost", str(lost), stage=lost.stage.name)
                self.pipeline.use_chain(self.recover(lost, report=report))

    def generate(self, requests: list[GenerationRequest]) -> tuple[list[GenerationResult], RunStats]:
        """Run requests to the end; results come back in request order."""
        collected: dict[str, GenerationResult] = {}

        class _Collect:
            def deliver(self, results: list[GenerationResult]) -> None:
                collected.update((r.request_id, r) for r in results)

        stats = self.run(ListSource(requests), _Collect())
        return [collected[r.request_id] for r in requests], stats

    def close(self) -> None:
        self.control.shutdown_all()
        if self.pipeline is not None:
            self.pipeline.close()
        self.results.close(linger=0)
        self.control.socket.close(linger=0)
