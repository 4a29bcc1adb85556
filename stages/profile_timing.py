"""Timing the serving code on a model's first layers: what a stage's profile measures.

The very code that serves steps (`load_shard`, `run_step`, `head_logits`) runs on random hidden
states and real weights, each step shape of stages.profile_request with one layer and with
PROFILE_LAYERS, timed in turns so that load from other processes falls on both alike. Under
`--weights auto` the same layers are also timed in each quantized format the planner may fall back to.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import torch

from layerbus.models.attention_shape import attention_shape
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.profile_request import PROFILE_LAYERS, ProfileRequest, ProfileShapes, profile_shapes
from layerbus.stages.shard import ShardSpec, StageShard, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import QUANTIZE_ON_LOAD, WeightChoice

StepRun = Callable[[StageShard], object]  # one step of a given shape, run on the layers it is given


def measure_timings(files, request: ProfileRequest, device: str,
                    weights: WeightChoice) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(median times of the serving code on the first layers, random inputs and real weights held in
    `weights`; under "auto" the layers' speed in each quantized format the planner may fall back to,
    relative to full precision: `measure_format_ratios`)."""
    try:
        return _measure_timings(files, request, device, weights)
    finally:
        gc.collect()  # the layers, cache and inputs timed are unreachable once it returns: freed now


def _measure_timings(files, request: ProfileRequest, device: str,
                     weights: WeightChoice) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    held = min(PROFILE_LAYERS, files.num_layers)
    full = load_shard(files, first_layers_spec(held, True, device, weights))
    extra = profile_shapes(request)
    generator = torch.Generator().manual_seed(0)
    hidden_rows = _random_hidden(request.micro_batch_size, full, generator)  # [rows, hidden]
    hidden_chunk = _random_hidden(request.prefill_tokens, full, generator)  # [prefill_tokens, hidden]
    runs = _shape_runs(full, held, request, extra, hidden_rows, hidden_chunk)
    sync = synchronizer(full.device)
    layers = {count: middle_shard(full, list(full.layers)[:count]) for count in sorted({1, held})}
    timings = _layer_timings(runs, layers, sync, held)
    ends = _end_timings(full, hidden_rows, extra.few_rows, generator, sync)
    timings.update({"layer_decode_s": timings["decode_per_layer_s"], "layer_prefill_s": timings["prefill_per_layer_s"],
                    **ends, "step_overhead_s": max(0.0, timings["decode_one_layer_s"] - timings["decode_per_layer_s"])})
    held_layers = layers[held]
    del full, layers  # the embedding and the head leave memory before the quantized layers load
    if weights.name != "auto":
        return timings, {}
    return timings, measure_format_ratios(files, weights, held_layers,
                                          {"decode": runs["decode"], "prefill": runs["prefill"]}, sync)


def first_layers_spec(layers: int, ends: bool, device: str, weights: WeightChoice) -> ShardSpec:
    """The first `layers` layers (with the embedding and head when `ends`) held in `weights`."""
    return ShardSpec(LayerRange(0, layers), ends, ends, device, weights.dtype, weights.quantize_to,
                     native=weights.name == "native")


def middle_shard(like: StageShard, layers) -> StageShard:
    """`layers` without the ends, as a middle stage runs them, with `like`'s config and rotary embedding."""
    spec = ShardSpec(LayerRange(0, len(layers)), False, False, like.spec.device, like.spec.dtype)
    return StageShard(spec, like.config, None, list(layers), None, None, like.rotary_emb)


def _random_hidden(rows: int, shard: StageShard, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, shard.config.hidden_size, generator=generator).to(shard.dtype)


def _shape_runs(full: StageShard, held: int, request: ProfileRequest, extra: ProfileShapes,
                hidden_rows: torch.Tensor, hidden_chunk: torch.Tensor) -> dict[str, StepRun]:
    """A step of each shape (SHAPES), over one KV cache long enough for the longest of them."""
    shape = attention_shape(full.config)
    rows = request.micro_batch_size
    arena = KVArena(list(range(held)), rows, shape.kv_heads, shape.head_dim, full.dtype, full.device,
                    max(extra.long_kv_length + 1, extra.late_start + request.prefill_tokens))

    def decode(count: int, kv_length: int) -> StepRun:
        step_rows = [StepRow(slot, kv_length, 1) for slot in range(count)]

        def run(shard: StageShard) -> object:
            arena.lengths[:count] = [kv_length] * count  # every row attends over kv_length cached positions
            return run_step(shard, arena, step_rows, hidden_rows[:count])
        return run

    def prefill(start: int) -> StepRun:
        step_rows = [StepRow(0, start, request.prefill_tokens)]

        def run(shard: StageShard) -> object:
            arena.lengths[0] = start
            return run_step(shard, arena, step_rows, hidden_chunk)
        return run

    return {"decode": decode(rows, request.kv_length), "few_rows": decode(extra.few_rows, request.kv_length),
            "long_kv": decode(rows, extra.long_kv_length), "prefill": prefill(0),
            "late_prefill": prefill(extra.late_start)}


def _layer_timings(runs: dict[str, StepRun], layers: dict[int, StageShard], sync: Callable[[], None],
                   held: int) -> dict[str, float]:
    """Per shape, the step on one layer ("<shape>_one_layer_s") and what each further layer adds."""
    timings: dict[str, float] = {}
    for name, run in runs.items():
        times = _paired_medians({count: (lambda shard=shard, run=run: run(shard)) for count, shard in layers.items()},
                                sync)
        timings[f"{name}_one_layer_s"] = times[1]
        timings[f"{name}_per_layer_s"] = _per_layer(times, held)
    return timings


def _end_timings(full: StageShard, hidden_rows: torch.Tensor, few_rows: int, generator: torch.Generator,
                 sync: Callable[[], None]) -> dict[str, float]:
    """The embedding of a decode step's tokens, and the head (final norm, LM head, log-softmax, the
    token) for its rows and for a few rows."""
    rows = hidden_rows.shape[0]
    token_ids = torch.randint(0, full.config.vocab_size, (rows, 1), generator=generator).to(full.device)
    normed = hidden_rows.to(full.device)

    def head(count: int) -> Callable[[], object]:
        def run() -> object:
            logits = head_logits(full, full.norm(normed[:count]))
            return torch.log_softmax(logits, dim=-1).argmax(dim=-1)
        return run

    with torch.inference_mode():
        embed = _median_time(lambda: full.embed_tokens(token_ids), sync)
        head_s = _median_time(head(rows), sync)
        head_few = _median_time(head(few_rows), sync)
    return {"embed_s": embed, "head_s": head_s, "head_few_rows_s": head_few}


def measure_format_ratios(files, full: WeightChoice, full_layers: StageShard, runs: dict[str, StepRun],
                          sync: Callable[[], None]) -> dict[str, dict[str, float]]:
    """For each quantized format `--weights auto` may fall back to (planner.weight_choice), how long the
    same layers take in it against full precision, per shape ("decode", "prefill"): timed in turns
    with the full-precision layers, so the ratio holds on a machine whose load moves. Measured, not
    assumed: on the CPUs measured Q8_0/Q4_1 tiles ran 1.1-8x slower than the float32 matmul
    (bench/bench_weights.py), on others they may run faster."""
    held = len(full_layers.layers)
    device = full_layers.spec.device
    shards = {"full": full_layers}
    for name, layout in QUANTIZE_ON_LOAD.items():
        quantized = load_shard(files, first_layers_spec(held, False, device, WeightChoice(name, full.dtype, layout)))
        shards[name] = middle_shard(full_layers, quantized.layers)
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


def _median_time(run: Callable[[], object], sync: Callable[[], None]) -> float:
    """Median time of one run, with fewer repetitions than the layers' (the ends are a small share of a step)."""
    return _paired_medians({0: run}, sync, min_reps=5, max_reps=25, budget_s=0.6)[0]


def _paired_medians(runs: dict[int | str, Callable[[], object]], sync: Callable[[], None], min_reps: int = 7,
                    max_reps: int = 31, budget_s: float = 1.0) -> dict[int | str, float]:
    """Median time of each run, timed in turns: load from other processes on a shared machine then
    falls on both alike, and the difference between layer counts (the per-layer cost) stays right."""
    for run in runs.values():
        for _ in range(2):  # warm-up: allocator, caches, lazy kernels
            run()
    sync()
    samples: dict[int | str, list[float]] = {key: [] for key in runs}
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
    """Waits for the device's queued work, so a timing covers the work and not only its launch."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None
