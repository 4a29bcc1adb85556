"""A stage serving the decode step for a while, so the broker learns what sharing a host costs.

The broker runs the probe on each stage alone and then on the stages of one machine at once; the
ratio of the two is what sharing that machine costs each (cores, memory bandwidth, whatever else
runs there now). Served together, the stages start at a common moment on the host's wall clock,
each at its own pace or, with ticks, each step in step with the others (`tick_probe`).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace
from typing import Callable

import torch

from layerbus.models.attention_shape import attention_shape
from layerbus.stages.emulation import StepTimer
from layerbus.stages.forward import run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.profile_request import PROFILE_LAYERS, ProfileRequest
from layerbus.stages.profile_timing import first_layers_spec, synchronizer
from layerbus.stages.shard import StageShard, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.weight_formats import WeightChoice

TICK_SLACK_S = 0.002  # a step that cannot start within this of its tick is left out (the ring would not wait)
CLOCKS_AGREE_S = 0.5  # a broker's start this close to the stage's own reckoning is on the same clock
MIN_TICKS = 4


def corun_probe(files, request: ProfileRequest, device: str, weights: WeightChoice,
                emulate_speed: float = 1.0) -> dict:
    """Serve the requested decode step on a few layers for `request.probe_s` seconds, as this stage
    serves steps (an emulated slower device sleeps after each, as the worker does), and report the
    median time a step lasts (with that sleep: what the stage's busy time counts). Never cached: what
    sharing the host costs is what runs there now. With `request.tick_period_s`, the steps start in
    step with the host's other stages (`tick_probe`)."""
    try:
        return _probe(files, request, device, weights, emulate_speed)
    finally:
        gc.collect()  # the probe's layers and KV cache are unreachable once it returns: freed now


def _probe(files, request: ProfileRequest, device: str, weights: WeightChoice, emulate_speed: float) -> dict:
    began = time.monotonic()
    request = on_this_clock(request)
    held = min(PROFILE_LAYERS, files.num_layers)
    serve = _step_server(load_shard(files, first_layers_spec(held, False, device, weights)), request, emulate_speed)
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


def _step_server(shard: StageShard, request: ProfileRequest, emulate_speed: float) -> Callable[[], float]:
    """A function that serves the requested decode step on `shard` as the worker does, and says how long
    it lasted (with an emulated device's sleep)."""
    shape = attention_shape(shard.config)
    rows = request.micro_batch_size
    arena = KVArena(list(range(len(shard.layers))), rows, shape.kv_heads, shape.head_dim, shard.dtype, shard.device,
                    request.kv_length + 1)
    hidden = torch.randn(rows, shard.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(shard.dtype)
    step_rows = [StepRow(slot, request.kv_length, 1) for slot in range(rows)]
    sync = synchronizer(shard.device)

    def serve() -> float:
        arena.lengths = [request.kv_length] * rows
        timer = StepTimer(shard.device.type, torch.get_num_threads())
        run_step(shard, arena, step_rows, hidden)
        sync()
        # An emulated slower device sleeps after each step as the worker does (stages/emulation.py); the
        # step lasts until the sleep ends, so the ratio of these is what sharing the host costs its steps
        pause = timer.sleep_s(emulate_speed)
        took = time.monotonic() - timer.started + pause
        time.sleep(pause)
        return took
    return serve


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
