"""Reading a cluster description (JSON, or TOML through the standard library) into stage profiles,
for planning a cluster one does not have at hand. The format is documented in the README.

Each stage gives its memory and either a relative `speed` (times then follow from the model's
FLOPs at `speed x reference_gflops`) or measured per-layer times in milliseconds."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from layerbus.broker.partition import ModelCost
from layerbus.broker.placement import Shapes, StageProfile

TOP_FIELDS = {"stages", "reference_gflops"}
STAGE_FIELDS = {"name", "device", "speed", "layer_decode_ms", "layer_prefill_ms", "embed_ms", "head_ms",
                "step_overhead_ms", "memory", "link_bandwidth", "link_latency_ms"}
DEFAULT_REFERENCE_GFLOPS = 50.0  # one modern CPU core in float32, about what speed = 1.0 means by default
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ClusterFileError(ValueError):
    """A cluster file that cannot be used; the message names the file, the stage and the field."""


def read_cluster_file(path: str | Path, cost: ModelCost, shapes: Shapes) -> list[StageProfile]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ClusterFileError(f"cannot read cluster file {path}: {error.strerror or error}") from None
    data = _parse(path, text)
    return profiles_from_description(data, cost, shapes, str(path))


def _parse(path: Path, text: str) -> dict:
    if path.suffix.lower() == ".toml":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ClusterFileError(f"{path} is not valid TOML: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ClusterFileError(f"{path} is not valid JSON ({error}); name the file *.toml for TOML") from None
    if not isinstance(data, dict):
        raise ClusterFileError(f"{path}: the top level must be an object with a 'stages' list")
    return data


def profiles_from_description(data: dict, cost: ModelCost, shapes: Shapes, source: str = "cluster") -> list[StageProfile]:
    unknown = set(data) - TOP_FIELDS
    if unknown:
        raise ClusterFileError(f"{source}: unknown top-level field(s) {sorted(unknown)}; known: {sorted(TOP_FIELDS)}")
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ClusterFileError(f"{source}: needs a non-empty 'stages' list ([[stages]] tables in TOML)")
    reference = _positive(data.get("reference_gflops", DEFAULT_REFERENCE_GFLOPS), f"{source}: reference_gflops")
    profiles, names = [], set()
    for index, stage in enumerate(stages):
        where = f"{source}: stage {index + 1}"
        if not isinstance(stage, dict):
            raise ClusterFileError(f"{where} must be an object/table, got {stage!r:.40}")
        where = f"{source}: stage {stage.get('name', index + 1)!r}"
        unknown = set(stage) - STAGE_FIELDS
        if unknown:
            raise ClusterFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(STAGE_FIELDS)}")
        name = stage.get("name", f"stage-{index}")
        if not isinstance(name, str) or not name or name in names:
            raise ClusterFileError(f"{where}: 'name' must be a unique non-empty string")
        names.add(name)
        profiles.append(_profile(name, stage, where, cost, shapes, reference))
    return profiles


def _profile(name: str, stage: dict, where: str, cost: ModelCost, shapes: Shapes, reference: float) -> StageProfile:
    if "memory" not in stage:
        raise ClusterFileError(f"{where}: 'memory' is required (bytes or a size like \"24GiB\")")
    rows, chunk = shapes.micro_batch_size, shapes.max_step_tokens
    layer_flops = max(cost.layer) if cost.layer else 0.0
    if ("speed" in stage) == ("layer_decode_ms" in stage):
        raise ClusterFileError(f"{where}: give either 'speed' (relative) or 'layer_decode_ms' (measured), not "
                               f"{'both' if 'speed' in stage else 'neither'}")
    if "speed" in stage:
        flops_per_s = _positive(stage["speed"], f"{where}: speed") * reference * 1e9
        decode, prefill = rows * layer_flops / flops_per_s, chunk * layer_flops / flops_per_s
        head, embed = rows * cost.head / flops_per_s, rows * cost.embed / flops_per_s
        for measured in ("layer_prefill_ms", "embed_ms", "head_ms"):
            if measured in stage:
                raise ClusterFileError(f"{where}: '{measured}' goes with 'layer_decode_ms', not with 'speed'")
    else:
        decode = _non_negative(stage["layer_decode_ms"], f"{where}: layer_decode_ms") / 1000
        # Missing times scale from the decode time by FLOPs: a prefill chunk does chunk/rows times
        # the work of a decode step, and the head head/layer times a layer's.
        prefill = _ms(stage, "layer_prefill_ms", where, decode * chunk / rows)
        head = _ms(stage, "head_ms", where, decode * cost.head / layer_flops if layer_flops else 0.0)
        embed = _ms(stage, "embed_ms", where, 0.0)
    try:
        return StageProfile(
            name=name, layer_decode_s=decode, layer_prefill_s=prefill, embed_s=embed, head_s=head,
            memory_budget=_size(stage["memory"], f"{where}: memory"),
            link_bandwidth=_size(stage["link_bandwidth"], f"{where}: link_bandwidth") if "link_bandwidth" in stage
            else math.inf,
            link_latency_s=_ms(stage, "link_latency_ms", where, 0.0),
            step_overhead_s=_ms(stage, "step_overhead_ms", where, 0.0),
            micro_batch_size=rows, prefill_tokens=chunk, device=str(stage.get("device", "?")))
    except ValueError as error:
        raise ClusterFileError(f"{where}: {error}") from None


def _ms(stage: dict, field: str, where: str, default: float) -> float:
    return _non_negative(stage[field], f"{where}: {field}") / 1000 if field in stage else default


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ClusterFileError(f"{what} must be a number, got {value!r:.40}")
    return float(value)


def _positive(value, what: str) -> float:
    number = _number(value, what)
    if number <= 0:
        raise ClusterFileError(f"{what} must be > 0, got {value}")
    return number


def _non_negative(value, what: str) -> float:
    number = _number(value, what)
    if number < 0:
        raise ClusterFileError(f"{what} must be >= 0, got {value}")
    return number


def _size(value, what: str) -> int:
    """Bytes, or a string with a unit: "24GiB", "1.25GB", "300MB"."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ClusterFileError(f"{what}: {value!r} is not a size; give bytes or a number with a unit "
                                   "(KB, MB, GB, KiB, MiB, GiB)")
        return int(float(match.group(1)) * _UNITS[unit])
    return int(_positive(value, what))
