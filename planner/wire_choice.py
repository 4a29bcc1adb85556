"""Which codec each link between stages uses: as configured, or chosen by `--wire auto`.

Auto mode picks, per link, among the codecs whose measured quality (a `layerbus wire-quality`
table for the model) stays within a budget: the most faithful one whose transfer hides behind the
step's compute, or the cheapest one when none does (a slow link, or bandwidth or compute not
known). The choice is a pure function; the table, the link bandwidths and the compute time are
inputs, so measured profiles plug in when they exist.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from layerbus.models.home import layerbus_home
from layerbus.wire.codecs import CODEC_NAMES, CODECS_BY_SIZE, DEFAULT_CODEC, wire_bytes

AUTO = "auto"


class WireConfigError(ValueError):
    """A wire setting that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class QualityBudget:
    """How much a codec may change the model's output, against the float32 wire (defaults: docs/weights-and-wire.md, "Wire codecs")."""

    max_mean_kl: float = 0.002  # mean KL(float32 || codec) per position, nats
    min_same_top: float = 0.995  # share of positions whose top token is unchanged


@dataclass(frozen=True)
class AutoWireInputs:
    """What `wire="auto"` decides from; all optional but the quality table."""

    quality_table: str | None = None  # JSON from `layerbus wire-quality --save` (None: the saved one for the model)
    link_bandwidth: tuple[float | None, ...] = ()  # bytes/s per link (missing or None = not measured)
    compute_s_per_step: float | None = None  # a stage's compute time per decode step (None = not measured)
    budget: QualityBudget = field(default_factory=QualityBudget)
    headroom: float = 0.5  # a codec "hides behind compute" when its transfer takes at most this share of it


def within_budget(quality: Mapping[str, Any] | None, budget: QualityBudget) -> bool:
    if quality is None:
        return False
    return quality["mean_kl"] <= budget.max_mean_kl and quality["same_top"] >= budget.min_same_top


def choose_codec(bandwidth_bytes_per_s: float | None, compute_s_per_step: float | None,
                 bytes_per_step_float32: float, quality_table: Mapping[str, Mapping[str, Any]],
                 budget: QualityBudget = QualityBudget(), headroom: float = 0.5) -> str:
    """The codec for one link. float32 is always allowed (it is the reference); others only within
    `budget` by `quality_table` (codec -> {mean_kl, same_top, bytes_ratio})."""
    allowed = [name for name in CODECS_BY_SIZE if name == DEFAULT_CODEC or within_budget(quality_table.get(name), budget)]
    cheapest = allowed[0]  # CODECS_BY_SIZE is cheapest first
    if not bandwidth_bytes_per_s or compute_s_per_step is None:
        return cheapest  # an unmeasured link may be slow: the cheapest codec within budget is the safe bet
    faithful_first = sorted(allowed, key=lambda name: 0.0 if name == DEFAULT_CODEC else quality_table[name]["mean_kl"])
    for name in faithful_first:
        transfer_s = bytes_per_step_float32 * _bytes_ratio(name, quality_table) / bandwidth_bytes_per_s
        if transfer_s <= headroom * compute_s_per_step:
            return name
    return cheapest


def _bytes_ratio(name: str, quality_table: Mapping[str, Mapping[str, Any]]) -> float:
    if name in quality_table and "bytes_ratio" in quality_table[name]:
        return float(quality_table[name]["bytes_ratio"])
    return wire_bytes(name, 1, 4096) / wire_bytes(DEFAULT_CODEC, 1, 4096)


def link_codecs(wire: tuple[str, ...] | str, num_links: int) -> list[str] | None:
    """Codec names per link for a fixed setting; None when `wire` asks for auto mode somewhere."""
    names = [wire] * num_links if isinstance(wire, str) else list(wire)
    if len(names) != num_links:
        raise WireConfigError(f"wire lists {len(names)} codec(s) {names} for {num_links} link(s) between "
                              f"{num_links + 1} stages: give one per link, or one name for all")
    for name in names:
        if name != AUTO and name not in CODEC_NAMES:
            raise WireConfigError(f"wire codec {name!r} is not one of {', '.join(CODEC_NAMES)} or {AUTO}")
    return None if AUTO in names else names


def plan_link_codecs(wire: tuple[str, ...] | str, num_links: int, bytes_per_step_float32: float,
                     model_dir: str, auto: AutoWireInputs = AutoWireInputs()) -> list[str]:
    """The codec of every link; links set to "auto" are chosen by choose_codec."""
    fixed = link_codecs(wire, num_links)
    if fixed is not None:
        return fixed
    names = [wire] * num_links if isinstance(wire, str) else list(wire)
    table = load_quality_table(model_dir, auto.quality_table)
    chosen = []
    for i, name in enumerate(names):
        if name != AUTO:
            chosen.append(name)
            continue
        bandwidth = auto.link_bandwidth[i] if i < len(auto.link_bandwidth) else None
        chosen.append(choose_codec(bandwidth, auto.compute_s_per_step, bytes_per_step_float32, table,
                                   auto.budget, auto.headroom))
    return chosen


def saved_table_path(model_dir: str | Path, home: Path | None = None) -> Path:
    """Where `layerbus wire-quality --save` keeps a model's table: one file per model directory."""
    resolved = Path(model_dir).expanduser().resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    return (home or layerbus_home()) / "wire_quality" / f"{resolved.name}-{digest}.json"


def load_quality_table(model_dir: str, path: str | None = None) -> dict[str, dict[str, Any]]:
    """codec -> measured quality, from `path` or the table saved for `model_dir`."""
    source = Path(path) if path else saved_table_path(model_dir)
    if not source.is_file():
        raise WireConfigError(f"--wire auto needs the measured quality of each codec for {model_dir}, and there is "
                              f"no table at {source}: run `layerbus wire-quality --model {model_dir} --save` first "
                              "(SmolLM2-135M: about 2 minutes on 2 cores), or pick a codec with --wire")
    try:
        report = json.loads(source.read_text())
        table = report["codecs"]
        for name, quality in table.items():
            float(quality["mean_kl"]), float(quality["same_top"])
    except (ValueError, KeyError, TypeError) as error:
        raise WireConfigError(f"{source} is not a wire-quality table ({type(error).__name__}: {error}); "
                              f"rerun `layerbus wire-quality --model {model_dir} --save`") from None
    return table
