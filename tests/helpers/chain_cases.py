"""The chain planner's table-test cases: an 8-layer model, stage profiles with hosts, cores and threads, and
one chain priced as the broker prices it."""

from __future__ import annotations

from layerbus.planner.placement import ModelMemory, PlanOptions, Shapes, StageProfile, plan_placement
from tests.helpers.placement_cases import SHAPES

LAYERS = 8
MODEL = ModelMemory(layer_weight_bytes=(100,) * LAYERS, embed_bytes=200, head_bytes=220, head_shares_embed=False,
                    kv_bytes_per_token=1, activation_bytes_per_token=8, hidden_size=2, intermediate_size=4,
                    num_attention_heads=1, vocab_size=8, dtype_bytes=4)


def stage(name: str, layer: float = 0.01, overhead: float = 0.0, budget: int = 10**9, host: str = "",
          cores: int = 0, threads: int = 0, share: float = 1.0) -> StageProfile:
    return StageProfile(name, layer_decode_s=layer, layer_prefill_s=layer * 4, embed_s=0.0, head_s=0.0,
                        memory_budget=budget, step_overhead_s=overhead, micro_batch_size=SHAPES.micro_batch_size,
                        prefill_tokens=SHAPES.max_step_tokens, host=host, host_cores=cores, threads=threads,
                        compute_share=share)


def plan_one(group, neighbours, chains=1):
    """Each chain with one micro-batch in flight more than it has stages, as the broker's default."""
    in_flight = len(group) + 1
    shapes = Shapes(num_slots=SHAPES.micro_batch_size * in_flight, micro_batch_size=SHAPES.micro_batch_size,
                    num_micro_batches=in_flight, max_context=SHAPES.max_context, max_step_tokens=SHAPES.max_step_tokens)
    return plan_placement(group, MODEL, shapes, PlanOptions(), neighbours=neighbours)


# Holds a little over half the model with its KV cache, workspace and reserve (one stage would need
# 2,230 bytes, each of two about 1,380, the first of them also the 8 bytes a position of hidden state it
# keeps of what it sends): every chain needs at least two such stages.
HALF_MODEL_BUDGET = 1900
