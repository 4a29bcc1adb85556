"""Bytes a step's hidden states take on the wire, per codec, without importing torch.

The same arithmetic as `wire.codecs.expected_parts` / `wire_bytes` (which need torch for dtypes),
for commands that only plan or measure (`layerbus netprobe`). tests/unit/test_link_cost.py checks that
both agree, and that they match what `encode` really produces, for every codec on a grid of shapes.
"""

from __future__ import annotations

CODEC_NAMES = ("float32", "float16", "bfloat16", "int8", "int4")  # as wire.codecs.CODEC_NAMES
# The short names `--weights` uses, accepted wherever a codec is named on the command line.
CODEC_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

# (group, block, outliers, bits) as wire.codecs.SCHEMES: channels per float16 scale, width of the
# Hadamard rotation, largest channels kept apart at float16, bits per quantized value.
_QUANTIZED = {"int8": (64, 64, 6, 8), "int4": (32, 64, 5, 4)}
_FLOAT16_BYTES = 2


def codec_name(text: str) -> str:
    """The codec's canonical name for `text` (a name or a short alias); ValueError lists the choices."""
    name = CODEC_ALIASES.get(text, text)
    if name not in CODEC_NAMES:
        raise ValueError(f"wire codec {text!r} is not one of {', '.join(CODEC_NAMES)} "
                         f"(or {', '.join(CODEC_ALIASES)})")
    return name


def codec_part_bytes(codec: str, rows: int, hidden: int, float_bytes: int = 4) -> dict[str, int]:
    """part name -> bytes of its raw frame, for hidden states [rows, hidden] sent with `codec`
    ("" is the main part; float32 carries `float_bytes` per value: 4, or 2 from a 16-bit stage)."""
    codec = codec_name(codec)
    if rows < 0 or hidden < 1:
        raise ValueError(f"hidden states need rows >= 0 and hidden >= 1, got [{rows}, {hidden}]")
    if codec == "float32":
        return {"": rows * hidden * float_bytes}
    if codec in ("float16", "bfloat16"):
        return {"": rows * hidden * _FLOAT16_BYTES}
    group, block, outliers, bits = _QUANTIZED[codec]
    multiple = max(group, block)
    padded = hidden + (-hidden % multiple)  # channels are zero-padded to whole groups and blocks
    parts = {"q": rows * padded * bits // 8, "scale": rows * (padded // group) * _FLOAT16_BYTES}
    kept = min(outliers, hidden)
    if kept:
        index_bytes = 2 if hidden <= 32767 else 4  # int16 indices while they fit
        parts["outlier_index"] = rows * kept * index_bytes
        parts["outlier_value"] = rows * kept * _FLOAT16_BYTES
    return parts


def codec_bytes(codec: str, rows: int, hidden: int, float_bytes: int = 4) -> int:
    """Bytes of all tensor frames of one message of [rows, hidden] hidden states with `codec`."""
    return sum(codec_part_bytes(codec, rows, hidden, float_bytes).values())
