"""The weight formats a stage can hold its layers in (`--weights`), and how a stage settles on one.

Both sides speak these names: the broker sends its `--weights` in each assignment, a stage started with
its own `--weights` keeps that one, and the stage reports what it loaded in READY. No torch here, so the
CLI can check the flag without loading it.

  auto    today's behaviour until the planner chooses: the stage's --dtype, full precision
  native  the checkpoint's own format: its blocks where it is quantized (a GGUF's Q4_0/Q4_1/Q8_0),
          else as auto
  fp32, bf16, fp16   full precision in that dtype (weights and compute)
  int8    quantized on load: symmetric, groups of 32 (GGUF's Q8_0 layout)
  int4    quantized on load: asymmetric, groups of 32 (GGUF's Q4_1 layout)

The groups of 32 are measured (`layerbus quality`, SmolLM2-135M over the sample corpus): 4-bit asymmetric g32 kept
100% of top tokens, g64 only 70%; int8 g32 98.1%, per output channel 96%.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_FORMATS = ("auto", "native", "fp32", "bf16", "fp16", "int8", "int4")
FULL_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # format -> the shard's dtype
QUANTIZE_ON_LOAD = {"int8": "q8_0", "int4": "q4_1"}  # format -> block layout (models.weight_blocks)
GROUP_SIZE = 32  # weights per block: one scale (and one minimum for q4_1) per 32 input channels


@dataclass(frozen=True)
class WeightChoice:
    """What a stage loads its decoder layers' linear weights as."""

    name: str  # the --weights value in force ("int4", "native", ...)
    dtype: str  # the shard's dtype: activations, norms, embeddings and unquantized weights
    quantize_to: str | None  # block layout to quantize full-precision linear weights into, None = keep them

    def describe(self, block_layouts: str | None = None) -> str:
        """What the stage reports: "int4 (q4_1 g32)", "native (q4_1, q8_0 g32)", "fp32", ...; `block_layouts`
        are those the loaded shard holds (native: whatever the checkpoint had)."""
        full = {dtype: name for name, dtype in FULL_PRECISION.items()}[self.dtype]
        if block_layouts:
            return f"{self.name} ({block_layouts} g{GROUP_SIZE})"
        return full if self.name in ("auto", "native") else self.name


def check_weight_format(name: str, flag: str = "--weights") -> str:
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"{flag} {name!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    return name


def choose_weights(stage_flag: str | None, broker_flag: str, stage_dtype: str) -> WeightChoice:
    """The stage's own --weights wins; else the broker's. Quantized formats compute in the stage's dtype."""
    name = check_weight_format(stage_flag if stage_flag is not None else broker_flag)
    if name in FULL_PRECISION:
        return WeightChoice(name, FULL_PRECISION[name], None)
    return WeightChoice(name, stage_dtype, QUANTIZE_ON_LOAD.get(name))
