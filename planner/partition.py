"""Cutting a model's layers into contiguous spans, one per stage: pure functions, table-tested.

The cost of a span is the compute it does per token: its layers, plus the embedding lookup on the
first stage and the LM head on the last. The head is no small thing: on SmolLM2 it costs as much
as eight decoder layers, so an equal count of layers leaves the last stage the bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerbus.models.attention_shape import attention_shape
from layerbus.wire.spans import LayerRange


@dataclass(frozen=True)
class ModelCost:
    """Per-token compute of the model's parts, in any consistent unit (FLOPs, measured seconds)."""

    layer: tuple[float, ...]  # cost of each decoder layer
    embed: float = 0.0  # the first stage's embedding lookup
    head: float = 0.0  # the last stage's final norm + LM head

    @property
    def num_layers(self) -> int:
        return len(self.layer)


def model_cost_from_config(config) -> ModelCost:
    """FLOPs per token from the config's shapes (2 FLOPs per weight; attention over the cache is
    left out: it is small next to the weights at the context lengths of batch jobs)."""
    hidden = config.hidden_size
    shape = attention_shape(config)
    attention = hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    mlp = 3 * hidden * config.intermediate_size
    layer = 2.0 * (attention + mlp)
    return ModelCost(layer=(layer,) * config.num_hidden_layers, embed=0.0, head=2.0 * hidden * config.vocab_size)


def equal_partition(num_layers: int, num_stages: int) -> list[LayerRange]:
    """The same number of layers per stage (the first stages take the remainder)."""
    _check(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    spans, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        spans.append(LayerRange(start, end))
        start = end
    return spans


def balanced_partition(cost: ModelCost, num_stages: int) -> list[LayerRange]:
    """Contiguous spans minimizing the largest stage cost (embedding on the first, head on the
    last), by dynamic programming over (layers, stages). Every stage gets at least one layer."""
    n = cost.num_layers
    _check(n, num_stages)
    prefix = [0.0]
    for c in cost.layer:
        prefix.append(prefix[-1] + c)

    def span_cost(start: int, end: int, stage: int) -> float:
        extra = (cost.embed if stage == 0 else 0.0) + (cost.head if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[s][e]: minimal max-cost placing layers [0, e) on stages 0..s-1, the last one ending at e.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for end in range(s, n - (num_stages - s) + 1):
            for start in range(s - 1, end):
                value = max(best[s - 1][start], span_cost(start, end, s - 1))
                # Ties go to the later cut, so earlier stages take more layers.
                if value <= best[s][end]:
                    best[s][end], cut[s][end] = value, start
    spans, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        spans.append(LayerRange(start, end))
        end = start
    return spans[::-1]


def stage_costs(cost: ModelCost, spans: list[LayerRange]) -> list[float]:
    last = len(spans) - 1
    return [sum(cost.layer[span.start:span.end]) + (cost.embed if i == 0 else 0.0) + (cost.head if i == last else 0.0)
            for i, span in enumerate(spans)]


def _check(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got num_stages={num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"num_stages={num_stages} exceeds num_layers={num_layers}: "
                         "every stage needs at least one layer; use fewer stages")
