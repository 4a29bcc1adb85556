"""Which weight format each stage holds, as the planner decides it: pure functions of the format a
stage was asked for (`--weights`, its own flag over the broker's) and the bytes each format needs.

Under `--weights auto` a stage holds full precision (its --dtype) where its memory allows, else int8,
else int4. In that order because quality falls in it (measured by `layerbus quality`, SmolLM2-135M over the sample
corpus against float32: int8 g32 KL 0.0013 / 98.1% same top token; 4-bit g32 re-quantized from
full precision costs more on a model not trained for it) and, on the CPUs measured, so does speed
(Q4_1/Q8_0 tiles run 1.1-8x slower than the float32 matmul: bench/bench_weights.py). The planner
plans the cluster at full precision first and allows int8, then int4, only when that plan fails, so
a roomy cluster never trades quality for speed: a stage under auto times its layers in int8 and int4
beside full precision (stages/profile_timing.py measure_format_ratios) and a quantized span is priced at that
speed, but a format measured faster is not chosen for it where full precision fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Callable, Sequence

AUTO_FALLBACKS = ("int8", "int4")  # after full precision, in order of preference under --weights auto
# Quality cost against float32, for `plan --explain` (`layerbus quality`'s table: SmolLM2-135M over the sample
# corpus; format -> (mean KL, same top token, a caveat)). `layerbus quality` measures a model's own.
MEASURED_QUALITY = {"int8": (0.0013, 0.981, ""),
                    "int4": (0.0, 1.0, "; that model ships as Q4_1: on others int4 costs more")}
QUALITY_SOURCE = "SmolLM2-135M, sample corpus"


def auto_levels() -> range:
    """How far down AUTO_FALLBACKS each successive plan may go (0: full precision only)."""
    return range(len(AUTO_FALLBACKS) + 1)


def weight_candidates(requested: str, full: str, level: int, known: Sequence[str]) -> tuple[str, ...]:
    """The formats a stage asked for `requested` may hold, best first. `full`: the full-precision
    format of the stages' dtype; `level`: how many of AUTO_FALLBACKS auto may use; `known`: the formats
    the model's sizes were computed for (auto skips others: a hand-made ModelMemory knows only `full`)."""
    if requested != "auto":
        return (requested,)
    return tuple(name for name in (full, *AUTO_FALLBACKS[:level]) if name == full or name in known)


def first_that_fits(candidates: Sequence[str], need: Callable[[str], int], room: int) -> str | None:
    """The first format whose need (bytes) is within `room`, or None when none is."""
    for name in candidates:
        if need(name) <= room:
            return name
    return None


def assigned_weights(requested: str, chosen: str) -> str:
    """What the broker tells a stage to hold: the planner's quantized choice under auto, else what was
    asked. Full precision chosen under auto stays "auto" so each stage keeps its own --dtype."""
    if requested == "auto" and chosen in AUTO_FALLBACKS:
        return chosen
    return requested


@dataclass(frozen=True)
class QualityTable:
    """Quality cost per weight format against float32: format -> (mean KL, same top token, a caveat)."""

    formats: dict[str, tuple[float, float, str]]
    source: str  # what it was measured on, for the reader


BUILT_IN_QUALITY = QualityTable(MEASURED_QUALITY, QUALITY_SOURCE)
REFERENCE_WIRE = "float32"  # the quality report's pairs on this wire are the weights' own cost


def quality_from_report(report, model_name: str, origin: str) -> QualityTable:
    """The weight formats' cost from a `layerbus quality --json` report (each format's pair on the
    float32 wire), for `plan --quality`. ValueError naming what is wrong in `origin` and the way out."""
    remedy = f"make it with `layerbus quality --model MODEL --json > {origin}`"
    if not isinstance(report, dict) or not isinstance(report.get("pairs"), list) or "model" not in report:
        raise ValueError(f"{origin}: not a `layerbus quality --json` report (no model and pairs); {remedy}")
    measured = str(report["model"]).rstrip("/").rsplit("/", 1)[-1]
    if measured != model_name:
        raise ValueError(f"{origin}: measured on {measured}, not on {model_name}: a format's cost is the model's "
                         f"own; {remedy}")
    formats: dict[str, tuple[float, float, str]] = {}
    for index, pair in enumerate(report["pairs"]):
        if not isinstance(pair, dict) or pair.get("wire") != REFERENCE_WIRE:
            continue
        kl, same_top = pair.get("mean_kl"), pair.get("same_top")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in (kl, same_top)):
            raise ValueError(f"{origin}: pair {index} ({pair.get('weights')}) has no numeric mean_kl and same_top; "
                             f"{remedy}")
        formats[str(pair.get("weights"))] = (float(kl), float(same_top), "")
    if not formats:
        raise ValueError(f"{origin}: no pair on the {REFERENCE_WIRE} wire; measure with `--wire {REFERENCE_WIRE}`")
    corpus = report.get("corpus", "?")
    return QualityTable(formats, f"{measured}, {PurePath(str(corpus)).name}, {origin}")


def quality_note(name: str, table: QualityTable = BUILT_IN_QUALITY) -> str:
    """The measured quality cost of a format, for `plan --explain` ("" for full precision, or a format
    the table did not measure)."""
    if name not in table.formats or name in ("fp32", "auto"):
        return ""
    kl, same_top, caveat = table.formats[name]
    return f"quality vs float32: KL {kl:g}, same top token {same_top:.1%} ({table.source}{caveat})"
