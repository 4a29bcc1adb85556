"""The broker: owns the control plane, the chain of stages, the schedule and the result socket."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import zmq

from broker.control import ClusterError, ControlPlane, StageInfo
from broker.model_info import ModelInfo, load_tokenizer, read_model_info
from broker.partition import balanced_partition, equal_partition, model_cost_from_config
from broker.pipeline import ListSource, Pipeline, PipelineConfig, RequestSource, ResultSink, RunStats
from broker.requests import GenerationRequest, GenerationResult
from broker.scheduler import BatchingConfig
from broker.wire_choice import AutoWireInputs, plan_link_codecs
from wire.spans import LayerRange

log = logging.getLogger("layerbus.broker")


@dataclass(frozen=True)
class BrokerConfig:
    """How the broker listens, waits for stages and splits the model."""

    model_dir: str  # Hugging Face model directory every stage can read at this path
    num_stages: int  # stages to wait for and chain
    control_bind: str = "tcp://127.0.0.1:*"  # ROUTER for registration/heartbeats ("*" = any port)
    results_bind: str = "tcp://127.0.0.1:*"  # PULL where the last stage returns tokens
    advertise_host: str | None = None  # host name stages on other machines use for results_bind
    partition: str = "balanced"  # "balanced" (by per-token cost, head included) or "equal" (layer count)
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
        if config.partition not in ("balanced", "equal"):
            raise ValueError(f"partition {config.partition!r} is not 'balanced' or 'equal'")
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
        self.link_codecs = plan_link_codecs(config.wire, config.num_stages - 1, step_bytes, config.model_dir,
                                            config.wire_auto)
        self.chain: list[StageInfo] = []
        self.spans: list[LayerRange] = []
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

    def plan_spans(self) -> list[LayerRange]:
        n, p = self.model.files.num_layers, self.config.num_stages
        if self.config.partition == "equal":
            return equal_partition(n, p)
        return balanced_partition(model_cost_from_config(self.model.files.config), p)

    def start(self) -> None:
        """Wait for the stages, give each its span, wait until all have loaded."""
        stages = self.control.wait_for_stages(self.config.num_stages, self.config.register_timeout_s)
        self.chain = sorted(stages, key=lambda s: s.name)  # a stable chain order for reproducible logs
        self.spans = self.plan_spans()
        log.info("placing %s: %s", self.model.path, ", ".join(f"{s.name} {span}" for s, span in zip(self.chain, self.spans)))
        if self.link_codecs:
            log.info("wire: %s", self.wire_summary())
        self.control.assign(self.chain, self.spans, str(self.model.path), self.results_address,
                            self.batching.num_slots, self.max_context, self.config.load_timeout_s, self.link_codecs)
        self.pipeline = Pipeline(self.context, self.control, self.chain, self.results, self.batching,
                                 set(self.model.eos_ids), self._detokenize, self.config.pipeline)

    def wire_summary(self) -> str:
        """The codec of each link, e.g. "stage-0 -> stage-1 int8, stage-1 -> stage-2 float16"."""
        names = [s.name for s in self.chain] or [f"stage {i}" for i in range(self.config.num_stages)]
        return ", ".join(f"{a} -> {b} {codec}" for a, b, codec in zip(names, names[1:], self.link_codecs))

    def run_info(self) -> dict:
        """For storage.run_info: the chain, its spans and the codec of each link."""
        names = [s.name for s in self.chain]
        return {"stages": [{"name": s.name, "layers": str(span)} for s, span in zip(self.chain, self.spans)],
                "wire": [{"from": a, "to": b, "codec": codec}
                         for a, b, codec in zip(names, names[1:], self.link_codecs)]}

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer().decode(token_ids, skip_special_tokens=True)

    def run(self, source: RequestSource, sink: ResultSink, should_stop=lambda: False) -> RunStats:
        if self.pipeline is None:
            raise ClusterError("the broker has not started: call start() first")
        return self.pipeline.run(source, sink, should_stop)

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
