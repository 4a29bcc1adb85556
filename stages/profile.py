"""A stage measuring itself for the placement planner: on its own device, dtype and threads, the
time of one decoder layer for a decode step and for a prefill chunk, the embedding and LM-head
costs, and its memory budget.

It times the very code that serves steps (`load_shard`, `run_step`, `head_logits`) on the model's
first layers. The measured times are cached as JSON under $LAYERBUS_HOME/profiles (or
$LAYERBUS_PROFILE_CACHE), keyed by everything they depend on, so a restarted stage answers at once;
the memory budget is read afresh every time.
An emulated speed is applied to the measured times, not measured: stages that differ only in
--emulate-speed share one measurement, and their profiles differ by exactly that factor.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from layerbus.models.attention_shape import attention_shape
from layerbus.models.home import profile_cache_dir
from layerbus.models.model_files import open_model_dir
from layerbus.models.openmp_waits import wait_policy
from layerbus.models.tensor_reader import SAFETENSORS_DTYPES, TensorReader
from layerbus.stages.emulation import StepTimer
from layerbus.stages.host import current_rss_bytes, proc_kib_field, release_freed_memory
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.shard import ShardSpec, StageShard, load_shard
from layerbus.wire import protocol
from layerbus.wire.frames import WireError
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import QUANTIZE_ON_LOAD, WEIGHT_FORMATS, WeightChoice, choose_weights

log = logging.getLogger("layerbus.stage")

PROFILE_VERSION = 4  # bump when what is measured changes: older cache files are then ignored
# Each shape is timed with one layer and with two: "<shape>_one_layer_s" is overhead + one layer,
# "<shape>_per_layer_s" what each further layer adds. decode: the requested rows at the requested KV
# length; few_rows: a quarter of the rows; long_kv: a longer KV length; prefill: one chunk from
# position 0; late_prefill: the same chunk after `late_start` cached positions. The broker fits a
# fixed + per-row + per-position cost from them (planner.step_cost.fit_costs).
PROFILE_LAYERS = 4  # timed with one layer and with this many: the difference is the per-layer cost
SHAPES = ("decode", "few_rows", "long_kv", "prefill", "late_prefill")
TIMING_FIELDS = ("layer_decode_s", "layer_prefill_s", "embed_s", "head_s", "step_overhead_s", "head_few_rows_s",
                 *(f"{shape}_{part}" for shape in SHAPES for part in ("one_layer_s", "per_layer_s")))


@dataclass(frozen=True)
class ProfileRequest:
    """What the broker asks a stage to measure (the PROFILE message's fields)."""

    model_dir: str  # the model to time (its first layers, embedding and head)
    micro_batch_size: int  # decode rows per step
    kv_length: int  # cached tokens each decode row attends over (a representative length)
    prefill_tokens: int  # tokens of one prefill chunk
    # > 0: not a profile but a co-run probe: serve the decode step for this many seconds (see corun_probe)
    probe_s: float = 0.0
    # A co-run probe in step (tick_period_s > 0): each step starts at tick_start + k * tick_period_s on the
    # host's wall clock, as every stage of the host is, and runs the held layers over and over to about
    # `tick_layers` layers (a stage's share of the model: the length of a real step). See `tick_probe`.
    tick_start: float = 0.0
    tick_period_s: float = 0.0
    tick_layers: int = 0
    # A co-run probe at its own pace served by several stages at once: the host's wall-clock time they all
    # start serving at (0: at once). Each loads its layers first, which takes each a different time.
    probe_start: float = 0.0
    # How long after the broker sent it tick_start / probe_start is: where this host's clock disagrees with
    # the broker's (another machine's) by more than CLOCKS_AGREE_S, the start is taken as this long after
    # the request came (the stages of one host get it at about the same moment). 0: the start as given.
    start_lead_s: float = 0.0
    # The broker's --weights (wire.weight_formats): the stage's own flag wins, as for its assignment. The
    # profile is taken in that format; under "auto" in full precision, with the quantized formats the
    # planner may fall back to timed beside it (`format_ratios`).
    weights: str = "auto"

    @classmethod
    def from_header(cls, header: dict) -> "ProfileRequest":
        protocol.require_fields(header, "profile", {"model_dir": str, "micro_batch_size": int, "kv_length": int,
                                                    "prefill_tokens": int})
        probe_s = header.get("probe_s", 0.0)
        if not isinstance(probe_s, (int, float)) or isinstance(probe_s, bool) or not 0 <= probe_s <= 60:
            raise WireError(f"profile probe_s must be a number of seconds in [0, 60], got {probe_s!r}")
        weights = header.get("weights", "auto")
        if weights not in WEIGHT_FORMATS:
            raise WireError(f"profile weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        ticks = {name: header.get(name, 0)
                 for name in ("tick_start", "tick_period_s", "tick_layers", "probe_start", "start_lead_s")}
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in ticks.values()) \
                or not isinstance(ticks["tick_layers"], int) or ticks["tick_period_s"] > 60:
            raise WireError(f"profile tick_start, tick_period_s (at most 60 s), tick_layers (an int), probe_start and "
                            f"start_lead_s must be numbers >= 0, got {ticks}")
        if 0 < ticks["tick_period_s"] < MIN_TICK_PERIOD_S or ticks["tick_period_s"] and not ticks["tick_layers"]:
            raise WireError(f"profile tick_period_s must be 0 or at least {MIN_TICK_PERIOD_S} s, with tick_layers, "
                            f"got {ticks}")
        if ticks["start_lead_s"] > MAX_START_AHEAD_S or not ticks["start_lead_s"] and \
                max(ticks["tick_start"], ticks["probe_start"]) > time.time() + MAX_START_AHEAD_S:
            raise WireError(f"profile start_lead_s, or without it tick_start / probe_start, must be at most "
                            f"{MAX_START_AHEAD_S:.0f} s ahead of this host's clock (now {time.time():.3f}), got {ticks}")
        request = cls(header["model_dir"], header["micro_batch_size"], header["kv_length"], header["prefill_tokens"],
                      float(probe_s), tick_start=float(ticks["tick_start"]), tick_period_s=float(ticks["tick_period_s"]),
                      tick_layers=ticks["tick_layers"], probe_start=float(ticks["probe_start"]),
                      start_lead_s=float(ticks["start_lead_s"]), weights=weights)
        if min(request.micro_batch_size, request.prefill_tokens) < 1 or request.kv_length < 0:
            raise WireError(f"profile shapes must be positive, got {request}")
        return request


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
    key = _cache_key(files.path, request, device, dtype, threads, weights.name)
    path = (cache_dir or profile_cache_dir()) / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"
    stored, cached = _read_cache(path, key), True
    if stored is None:
        cached = False
        started = time.monotonic()
        stored = measure_timings(files, request, device, weights)
        _write_cache(path, key, *stored)
        log.info("profiled %s on %s/%s (weights %s) in %.1f s: %s%s", files.path.name, device, dtype, weights.name,
                 time.monotonic() - started, ", ".join(f"{k} {1000 * v:.2f} ms" for k, v in stored[0].items()),
                 "".join(f"; {name} layers {r['decode']:.2f}x decode, {r['prefill']:.2f}x prefill"
                         for name, r in stored[1].items()))
    measured, ratios = stored
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


@dataclass(frozen=True)
class ProfileShapes:
    """The shapes timed besides the requested ones (see SHAPES)."""

    few_rows: int
    long_kv_length: int
    late_start: int


def profile_shapes(request: ProfileRequest) -> ProfileShapes:
    kv = request.kv_length
    return ProfileShapes(few_rows=max(1, request.micro_batch_size // 4), long_kv_length=max(2 * kv, kv + 64),
                         late_start=max(kv, request.prefill_tokens))


def host_cores() -> int:
    """Cores this process may run on (its affinity), which the stages on this machine share."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def corun_probe(files, request: ProfileRequest, device: str, weights: WeightChoice,
                emulate_speed: float = 1.0) -> dict:
    """Serve the requested decode step on a few layers for `request.probe_s` seconds, as this stage
    serves steps (an emulated slower device sleeps after each, as the worker does), and report the
    median time a step lasts (with that sleep: what the stage's busy time counts). Never cached: the
    broker runs it on each stage alone and then on the stages of one machine at once, and the ratio is
    what sharing that machine costs each (cores, memory bandwidth, whatever else runs there now). With
    `request.tick_period_s`, the steps start in step with the host's other stages (`tick_probe`)."""
    began = time.monotonic()
    request = on_this_clock(request)
    held = min(PROFILE_LAYERS, files.num_layers)
    full = load_shard(files, _spec(held, False, device, weights))
    shape = attention_shape(full.config)
    rows = request.micro_batch_size
    arena = KVArena(list(range(held)), rows, shape.kv_heads, shape.head_dim, full.dtype, full.device,
                    request.kv_length + 1)
    hidden = torch.randn(rows, full.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(full.dtype)
    step_rows = [StepRow(slot, request.kv_length, 1) for slot in range(rows)]
    sync = synchronizer(full.device)

    def serve() -> float:
        """One step as the worker serves it; how long it lasted (with an emulated device's sleep)."""
        arena.lengths = [request.kv_length] * rows
        timer = StepTimer(full.device.type, torch.get_num_threads())
        run_step(full, arena, step_rows, hidden)
        sync()
        # An emulated slower device sleeps after each step as the worker does (stages/emulation.py); the
        # step lasts until the sleep ends, so the ratio of these is what sharing the host costs its steps
        pause = timer.sleep_s(emulate_speed)
        took = time.monotonic() - timer.started + pause
        time.sleep(pause)
        return took

    try:
        if request.tick_period_s > 0:
            return tick_probe(serve, request, max(1, round(request.tick_layers / held)))
        if request.probe_start > 0:
            # Served with the host's other stages: all start at once, each having loaded its layers and warmed
            # up. Started as each was ready, three one-thread stages on two cores overlapped for only part of
            # the probe and measured 1.23x where, all at once, cores alone make it 1.5x.
            serve()
            _wait_until(request.probe_start)
        samples = []
        started = time.monotonic()
        while time.monotonic() - started < request.probe_s or len(samples) < 3:
            samples.append(serve())
        # probe_ready_s: from the request to the first step served (loading and warming up): how long before
        # a start in common the broker sends the probes served together
        return {"probe_step_s": statistics.median(samples[1:] if len(samples) > 3 else samples),
                "probe_steps": len(samples), "probe_ready_s": started - began + samples[0]}
    finally:
        del full, arena
        gc.collect()


TICK_SLACK_S = 0.002  # a step that cannot start within this of its tick is left out (the ring would not wait)
MIN_TICK_PERIOD_S = 0.001
MAX_START_AHEAD_S = 60.0  # a start further ahead than this on the stage's clock is refused, not waited for
CLOCKS_AGREE_S = 0.5  # a broker's start this close to the stage's own reckoning is on the same clock
MIN_TICKS = 4


def on_this_clock(request: ProfileRequest) -> ProfileRequest:
    """The request with its starts on this host's clock, as it comes in: as the broker gave them where the
    two clocks agree (the broker's machine, or one in sync with it), else `start_lead_s` from now. The
    stages probed together are on one host, so they agree with each other either way; a start taken from
    a clock seconds off would have them all wait that long, or start each as it was ready."""
    start = request.tick_start if request.tick_period_s > 0 else request.probe_start
    if not start or not request.start_lead_s:
        return request
    here = time.time() + request.start_lead_s
    if abs(start - here) <= CLOCKS_AGREE_S:
        return request
    return replace(request, tick_start=here if request.tick_period_s > 0 else request.tick_start,
                   probe_start=here if request.probe_start else 0.0)


def _wait_until(at: float) -> None:
    """Until `at` on the wall clock (the host's stages' common clock). The last 2 ms are spun: a sleep wakes
    a millisecond or more late, and each stage's by a different amount."""
    while (wait := at - time.time()) > 0.002:
        time.sleep(wait - 0.002)
    while time.time() < at:
        pass


def tick_probe(serve: Callable[[], float], request: ProfileRequest, repeats: int) -> dict:
    """The co-run probe in step: each step (`repeats` served back to back: a real step's length) starts at
    the next tick of the host's wall clock, as the ring of micro-batches starts the steps of a host's
    stages together. Three one-thread stages on two cores started together finish unevenly (the kernel
    gives one a core of its own), and the ring waits for the last: 1.65x the step alone at 45 ms, where
    each at its own pace took 1.5x (bench/bench_cosched.py). Reports [tick, seconds] per step started
    on time; the broker compares the ticks every stage of the host started."""
    serve()  # the first step pays for warming up, before any tick
    ticks = max(MIN_TICKS, int(request.probe_s / request.tick_period_s))
    steps = []
    for tick in range(ticks):
        at = request.tick_start + tick * request.tick_period_s
        if time.time() > at + TICK_SLACK_S:
            continue  # the shard loaded late, or the step before overran its tick: not a start in step
        _wait_until(at)
        began = time.monotonic()
        for _ in range(repeats):
            serve()
        steps.append([tick, time.monotonic() - began])
    return {"probe_ticks": steps, "probe_tick_repeats": repeats}


def emulated_timings(measured: dict[str, float], emulate_speed: float) -> dict[str, float]:
    """The profile of a device running at `emulate_speed` of this one: the worker sleeps the rest of
    each step, so every time is the measured one divided by that fraction."""
    return {name: value / emulate_speed for name, value in measured.items()}


def _spec(layers: int, ends: bool, device: str, weights: WeightChoice) -> ShardSpec:
    """The first `layers` layers (with the embedding and head when `ends`) held in `weights`."""
    return ShardSpec(LayerRange(0, layers), ends, ends, device, weights.dtype, weights.quantize_to,
                     native=weights.name == "native")


def measure_timings(files, request: ProfileRequest, device: str,
                    weights: WeightChoice) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(median times of the serving code on the first layers, random inputs and real weights held in
    `weights`; under "auto" the layers' speed in each quantized format the planner may fall back to,
    relative to full precision: `measure_format_ratios`)."""
    held = min(PROFILE_LAYERS, files.num_layers)
    full = load_shard(files, _spec(held, True, device, weights))
    config, rotary, full_layers = full.config, full.rotary_emb, list(full.layers)
    dtype = weights.dtype

    def middle(count: int, layers=None) -> StageShard:  # the same modules without the ends, as a middle stage runs them
        return StageShard(ShardSpec(LayerRange(0, count), False, False, device, dtype), config, None,
                          list(layers if layers is not None else full_layers)[:count], None, None, rotary)

    shape = attention_shape(config)
    rows = request.micro_batch_size
    extra = profile_shapes(request)
    arena = KVArena(list(range(held)), rows, shape.kv_heads, shape.head_dim, full.dtype, full.device,
                    max(extra.long_kv_length + 1, extra.late_start + request.prefill_tokens))
    generator = torch.Generator().manual_seed(0)
    hidden_rows = torch.randn(rows, config.hidden_size, generator=generator).to(full.dtype)
    hidden_chunk = torch.randn(request.prefill_tokens, config.hidden_size, generator=generator).to(full.dtype)
    sync = synchronizer(full.device)

    def decode(count: int, kv_length: int) -> Callable[[], object]:
        step_rows = [StepRow(slot, kv_length, 1) for slot in range(count)]

        def run(shard: StageShard) -> object:
            arena.lengths[:count] = [kv_length] * count  # every row attends over kv_length cached positions
            return run_step(shard, arena, step_rows, hidden_rows[:count])
        return run

    def prefill(start: int) -> Callable[[], object]:
        step_rows = [StepRow(0, start, request.prefill_tokens)]

        def run(shard: StageShard) -> object:
            arena.lengths[0] = start
            return run_step(shard, arena, step_rows, hidden_chunk)
        return run

    shards = {count: middle(count) for count in sorted({1, held})}
    shape_runs = {"decode": decode(rows, request.kv_length), "few_rows": decode(extra.few_rows, request.kv_length),
                  "long_kv": decode(rows, extra.long_kv_length), "prefill": prefill(0),
                  "late_prefill": prefill(extra.late_start)}
    timings: dict[str, float] = {}
    for name, run in shape_runs.items():
        times = _paired_medians({count: (lambda shard=shard, run=run: run(shard)) for count, shard in shards.items()},
                                sync)
        per_layer = _per_layer(times, held)
        timings[f"{name}_one_layer_s"] = times[1]
        timings[f"{name}_per_layer_s"] = per_layer
    token_ids = torch.randint(0, config.vocab_size, (rows, 1), generator=generator).to(full.device)
    normed = hidden_rows.to(full.device)

    def head(count: int) -> Callable[[], object]:
        def run() -> object:
            logits = head_logits(full, full.norm(normed[:count]))
            return torch.log_softmax(logits, dim=-1).argmax(dim=-1)
        return run

    with torch.inference_mode():
        embed = _median_time(lambda: full.embed_tokens(token_ids), sync)
        head_s = _median_time(head(rows), sync)
        head_few = _median_time(head(extra.few_rows), sync)
    timings.update({"layer_decode_s": timings["decode_per_layer_s"], "layer_prefill_s": timings["prefill_per_layer_s"],
                    "embed_s": embed, "head_s": head_s, "head_few_rows_s": head_few,
                    "step_overhead_s": max(0.0, timings["decode_one_layer_s"] - timings["decode_per_layer_s"])})
    held_shard = shards[held]
    del full, shards, full_layers
    ratios = {}
    if weights.name == "auto":
        ratios = measure_format_ratios(files, device, weights, held_shard, middle,
                                       {"decode": shape_runs["decode"], "prefill": shape_runs["prefill"]}, sync)
    del arena, held_shard, shape_runs
    gc.collect()
    return timings, ratios


def measure_format_ratios(files, device: str, full: WeightChoice, full_layers: StageShard,
                          middle: Callable[..., StageShard], runs: dict[str, Callable[[StageShard], object]],
                          sync: Callable[[], None]) -> dict[str, dict[str, float]]:
    """For each quantized format `--weights auto` may fall back to (planner.weight_choice), how long the
    same layers take in it against full precision, per shape ("decode", "prefill"): timed in turns
    with the full-precision layers, so the ratio holds on a machine whose load moves. Measured, not
    assumed: on the CPUs measured Q8_0/Q4_1 tiles ran 1.1-8x slower than the float32 matmul
    (bench/bench_weights.py), on others they may run faster."""
    held = len(full_layers.layers)
    shards = {"full": full_layers}
    for name, layout in QUANTIZE_ON_LOAD.items():
        quantized = load_shard(files, _spec(held, False, device, WeightChoice(name, full.dtype, layout)))
        shards[name] = middle(held, quantized.layers)
    ratios: dict[str, dict[str, float]] = {name: {} for name in QUANTIZE_ON_LOAD}
    for shape, run in runs.items():
        # Fewer repetitions than the profile's own shapes: a ratio needs less precision than a cost.
        times = _paired_medians({name: (lambda shard=shard, run=run: run(shard)) for name, shard in shards.items()},
                                sync, min_reps=3, max_reps=15, budget_s=0.5)
        for name in QUANTIZE_ON_LOAD:
            ratios[name][shape] = times[name] / times["full"] if times["full"] > 0 else 1.0
    return ratios


def _per_layer(times: dict[int, float], held: int) -> float:
    # t(k) = overhead + k x layer: the difference of two layer counts cancels the fixed cost per step.
    if held > 1 and times[held] > times[1]:
        return (times[held] - times[1]) / (held - 1)
    return times[1]


def _median_time(run: Callable[[], object], sync: Callable[[], None], min_reps: int = 5,
                 max_reps: int = 25, budget_s: float = 0.6) -> float:
    for _ in range(2):  # warm-up: allocator, caches, lazy kernels
        run()
    sync()
    samples, started = [], time.perf_counter()
    while len(samples) < min_reps or (len(samples) < max_reps and time.perf_counter() - started < budget_s):
        begin = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def _paired_medians(runs: dict[int, Callable[[], object]], sync: Callable[[], None], min_reps: int = 7,
                    max_reps: int = 31, budget_s: float = 1.0) -> dict[int, float]:
    """Median time of each run, timed in turns: load from other processes on a shared machine then
    falls on both alike, and the difference between layer counts (the per-layer cost) stays right."""
    for run in runs.values():
        for _ in range(2):  # warm-up: allocator, caches, lazy kernels
            run()
    sync()
    samples: dict[int, list[float]] = {key: [] for key in runs}
    started = time.perf_counter()
    while (len(samples[next(iter(runs))]) < min_reps
           or (len(samples[next(iter(runs))]) < max_reps and time.perf_counter() - started < budget_s)):
        for key, run in runs.items():
            begin = time.perf_counter()
            run()
            sync()
            samples[key].append(time.perf_counter() - begin)
    return {key: statistics.median(values) for key, values in samples.items()}


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def memory_figures(files, device: str, given_budget: int | None, runtime_bytes: int,
                   emulate_memory: int | None = None) -> dict:
    """`memory_budget`: what the planner may fill with weights, KV cache and workspace, with what came
    out of it first. A --memory-budget is the stage's whole resident memory (what VmHWM reads), so
    on a CPU its runtime (interpreter, torch and the libraries, measured before anything was loaded:
    about 0.4 GiB) and the loader's transient (one tensor in its stored dtype, read before conversion)
    come out of it; without one the budget is the memory free now, which the runtime already occupies,
    so only the loader's transient does. On a GPU the budget is device memory: host memory is not
    part of it. An emulated memory (--emulate-memory) is the planner's budget as given."""
    loader = largest_tensor_bytes(files)
    on_cpu = torch.device(device).type == "cpu"
    if emulate_memory is not None:
        return {"memory_budget": emulate_memory, "memory_budget_given": None, "runtime_bytes": 0,
                "loader_peak_bytes": 0, "emulated_memory": True}
    if given_budget is None:
        usable = free_memory_bytes(device) - loader
    else:
        usable = given_budget - loader - (runtime_bytes if on_cpu else 0)
    return {"memory_budget": max(0, usable), "memory_budget_given": given_budget,
            "runtime_bytes": runtime_bytes if on_cpu else 0, "loader_peak_bytes": loader}


def largest_tensor_bytes(files) -> int:
    """The largest tensor of the checkpoint as stored: the loader's one temporary when it converts a
    dtype (models/tensor_reader.py reads everything else straight into its parameter)."""
    reader = TensorReader(files.tensor_files, files.path)
    largest = 0
    for name in files.tensor_files:
        stored = SAFETENSORS_DTYPES.get(reader.dtype_name(name))
        largest = max(largest, math.prod(reader.shape(name)) * (stored.itemsize if stored is not None else 4))
    return largest


def free_memory_bytes(device: str) -> int:
    """Memory this stage could fill now: free device memory on a GPU, available RAM on a CPU."""
    parsed = torch.device(device)
    if parsed.type == "cuda":
        return int(torch.cuda.mem_get_info(parsed)[0])
    if parsed.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    available = proc_kib_field("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
