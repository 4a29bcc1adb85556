"""The placement planner's table-test cases: a small model of N layers, stage profiles, the shapes a step
runs at, and every split of N layers into k spans (for brute force)."""

from __future__ import annotations

import itertools
import math
import random

from layerbus.planner.placement import ModelMemory, Shapes, StageProfile
from layerbus.wire.spans import LayerRange

SHAPES = Shapes(num_slots=4, micro_batch_size=2, num_micro_batches=3, max_context=8, max_step_tokens=4)


def small_model(num_layers: int, layer_bytes: int = 100, tied: bool = False, rng: random.Random | None = None):
    layers = tuple(rng.randint(50, 150) if rng else layer_bytes for _ in range(num_layers))
    return ModelMemory(layer_weight_bytes=layers, embed_bytes=200, head_bytes=220 if not tied else 210,
                       head_shares_embed=tied, kv_bytes_per_token=1, activation_bytes_per_token=8, hidden_size=2,
                       intermediate_size=4, num_attention_heads=1, vocab_size=8, dtype_bytes=4)


def profile(name: str, layer: float, budget: int = 10**9, head: float = 0.0, embed: float = 0.0,
            bandwidth: float = math.inf, overhead: float = 0.0) -> StageProfile:
    return StageProfile(name, layer_decode_s=layer, layer_prefill_s=layer * 4, embed_s=embed, head_s=head,
                        memory_budget=budget, link_bandwidth=bandwidth, step_overhead_s=overhead,
                        micro_batch_size=SHAPES.micro_batch_size, prefill_tokens=SHAPES.max_step_tokens)


def compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]
