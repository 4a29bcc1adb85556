"""A stage measuring itself for the placement planner: on its own device, dtype and threads, the
time of one decoder layer for a decode step and for a prefill chunk, the embedding and LM-head
costs, and its memory budget.

It times the very code that serves steps on the model's first layers (stages.profile_timing), or
answers a co-run probe (stages.corun_probe). The measured times are cached as JSON under
$LAYERBUS_HOME/profiles (or $LAYERBUS_PROFILE_CACHE), keyed by everything they depend on, so a
restarted stage answers at once; the memory budget (stages.memory_budget) is read afresh every time.
An emulated speed is applied to the measured times, not measured: stages that differ only in
--emulate-speed share one measurement, and their profiles differ by exactly that factor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from layerbus.models.home import profile_cache_dir
from layerbus.models.model_files import open_model_dir
from layerbus.models.openmp_waits import wait_policy
from layerbus.stages.corun_probe import corun_probe
from layerbus.stages.host import current_rss_bytes, release_freed_memory
from layerbus.stages.memory_budget import memory_figures
from layerbus.stages.profile_request import TIMING_FIELDS, ProfileRequest, profile_shapes
from layerbus.stages.profile_timing import measure_timings
from layerbus.wire.weight_formats import QUANTIZE_ON_LOAD, WeightChoice, choose_weights

log = logging.getLogger("layerbus.stage")

PROFILE_VERSION = 4  # bump when what is measured changes: older cache files are then ignored


def profile_stage(request: ProfileRequest, device: str, dtype: str, threads: int, emulate_speed: float = 1.0,
                  memory_budget: int | None = None, cache_dir: Path | None = None, runtime_bytes: int = 0,
                  emulate_memory: int | None = None, own_weights: str | None = None) -> dict:
    """The PROFILE_RESULT fields: timings (measured, or from the cache when this setup was measured
    before, then slowed by the emulated speed) in the stage's weight format (`own_weights`, its
    --weights, over the request's), the memory budget (`memory_figures`) and the shapes they were
    measured at. `runtime_bytes`: the stage's resident memory before it loaded anything."""
    files = open_model_dir(request.model_dir)
    weights = choose_weights(own_weights, request.weights, dtype)
    if request.probe_s > 0:
        return corun_probe(files, request, device, weights, emulate_speed)
    (measured, ratios), cached = _cached_or_measured(files, request, device, dtype, threads, weights, cache_dir)
    # The runtime is what the stage holds besides weights. Timing layers leaves some of it behind for good
    # (torch's and oneDNN's per-shape caches, the block kernel: 30 MiB on a 1.28B model's first stage after
    # the freed layers were trimmed), and a span's load starts from there: counted as runtime too, so the
    # planner does not fill memory the stage no longer has.
    release_freed_memory()
    runtime_bytes = max(runtime_bytes, current_rss_bytes()) if runtime_bytes else 0
    return dict(emulated_timings(measured, emulate_speed), **asdict(profile_shapes(request)),
                **memory_figures(files, device, memory_budget, runtime_bytes, emulate_memory),
                micro_batch_size=request.micro_batch_size, prefill_tokens=request.prefill_tokens, cached=cached,
                host_cores=host_cores(), emulate_speed=emulate_speed, weights_profiled=weights.name,
                format_ratios=ratios)


def _cached_or_measured(files, request: ProfileRequest, device: str, dtype: str, threads: int,
                        weights: WeightChoice, cache_dir: Path | None):
    """((timings, format ratios), whether they came from the cache): measured and cached when this
    setup was not measured before."""
    key = _cache_key(files.path, request, device, dtype, threads, weights.name)
    path = (cache_dir or profile_cache_dir()) / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"
    stored = _read_cache(path, key)
    if stored is not None:
        return stored, True
    started = time.monotonic()
    stored = measure_timings(files, request, device, weights)
    _write_cache(path, key, *stored)
    log.info("profiled %s on %s/%s (weights %s) in %.1f s: %s%s", files.path.name, device, dtype, weights.name,
             time.monotonic() - started, ", ".join(f"{k} {1000 * v:.2f} ms" for k, v in stored[0].items()),
             "".join(f"; {name} layers {r['decode']:.2f}x decode, {r['prefill']:.2f}x prefill"
                     for name, r in stored[1].items()))
    return stored, False


def host_cores() -> int:
    """Cores this process may run on (its affinity), which the stages on this machine share."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def emulated_timings(measured: dict[str, float], emulate_speed: float) -> dict[str, float]:
    """The profile of a device running at `emulate_speed` of this one: the worker sleeps the rest of
    each step, so every time is the measured one divided by that fraction."""
    return {name: value / emulate_speed for name, value in measured.items()}


def device_description(device: str) -> str:
    parsed = torch.device(device)
    if parsed.type == "cuda":
        return torch.cuda.get_device_name(parsed)
    if parsed.type == "cpu":
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                for line in cpuinfo:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return parsed.type


def _cache_key(model_path: Path, request: ProfileRequest, device: str, dtype: str, threads: int,
               weights: str) -> dict:
    config_text = (model_path / "config.json").read_bytes()
    return {"version": PROFILE_VERSION, "device": device, "device_name": device_description(device),
            "model": str(model_path.resolve()), "config_sha256": hashlib.sha256(config_text).hexdigest(),
            "dtype": dtype, "threads": threads, "openmp_wait_policy": wait_policy(), "torch": torch.__version__,
            "weights": weights, "shapes": asdict(request) | {"model_dir": None, "weights": None}}


def _read_ratios(stored) -> dict[str, dict[str, float]] | None:
    if not isinstance(stored, dict):
        return None
    ratios = {}
    for name, shapes in stored.items():
        if (name not in QUANTIZE_ON_LOAD or not isinstance(shapes, dict) or set(shapes) != {"decode", "prefill"}
                or not all(isinstance(v, (int, float)) and v > 0 for v in shapes.values())):
            return None
        ratios[name] = {shape: float(value) for shape, value in shapes.items()}
    return ratios


def _read_cache(path: Path, key: dict) -> tuple[dict[str, float], dict[str, dict[str, float]]] | None:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none yet, or unreadable: measure again
    if not isinstance(stored, dict):
        return None  # not a profile this version wrote
    timings = stored.get("timings")
    if stored.get("key") != key or not isinstance(timings, dict) or set(timings) != set(TIMING_FIELDS):
        return None
    if not all(isinstance(v, (int, float)) and v >= 0 for v in timings.values()):
        return None
    ratios = _read_ratios(stored.get("format_ratios", {}))
    if ratios is None:
        return None
    return {name: float(timings[name]) for name in TIMING_FIELDS}, ratios


def _write_cache(path: Path, key: dict, timings: dict[str, float], ratios: dict[str, dict[str, float]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"key": key, "timings": timings, "format_ratios": ratios,
                                         "measured_at": time.time()}, indent=1))
        os.replace(temporary, path)
    except OSError as error:  # a read-only home only costs a re-measurement next time
        log.warning("could not cache the profile in %s: %s", path, error)
