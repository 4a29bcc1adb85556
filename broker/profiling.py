"""The broker's side of placement: ask each registered stage to profile itself, time each stage's
link with echoed probes, and turn the answers into `StageProfile`s for the planner.

Stages are profiled one after another, not at once: stages sharing a machine would otherwise slow
each other down and each would measure a device busier than it will be. A stage's link is timed
between the broker and the stage (a probe of one step's activations against an empty one); that
prices the links between it and the broker, and stands in for its link to the next stage where the
stages could not time that one themselves (broker.link_probing). CPU stages sharing a machine are then probed for what sharing
costs them (`measure_sharing`); those factors are cached beside the stages' profiles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from layerbus.broker.control import ControlPlane, StageInfo
from layerbus.broker.control_io import ECHO_TIMEOUT_S, LINK_TIMED
from layerbus.broker.waits import Liveness, NoReply, Reply, Steps, run_blocking
from layerbus.planner.placement import ModelMemory, StageProfile
from layerbus.planner.step_cost import LinearCost, ProfilePoint, StepWork, decode_step, fit_costs, prefill_step
from layerbus.models.home import profile_cache_dir
from layerbus.models.openmp_waits import wait_policy
from layerbus.wire import protocol

log = logging.getLogger("layerbus.broker")

MAX_PROBE_BYTES = 512 << 10  # control messages are capped at 1 MiB
SHARING_CACHE_VERSION = 5  # bump when what the co-run probe measures changes: older cache files are ignored
# (2: an emulated stage's step lasts its CPU time / F, stages/emulation.py; 3: the median of rounds;
# 4: the probe in step, `lockstep_excess_s`; 5: the stages probed together start at one time)
# From sending a probe served together to its start: each stage loads its layers and warms up first. Twice
# the longest a stage took to that alone (with a margin), or this where a stage did not say.
UNKNOWN_LEAD_S = 0.4
PROFILE_SHAPES = ("decode", "few_rows", "long_kv", "prefill", "late_prefill")  # as stages/profile.py SHAPES


@dataclass(frozen=True)
class ProfilingConfig:
    """How the broker measures its stages."""

    kv_length: int = 0  # cached tokens per decode row while timing (0 = min(256, max_context // 2))
    probe_rounds: int = 7  # echoes per probe size; the median counts
    timeout_s: float = 300.0  # one stage's profile must arrive within this
    probe_s: float = 1.5  # stages sharing a machine: serve steps this long alone and together (0 = do not measure)
    # ... split into this many rounds (every stage alone, then all at once, each for probe_s / sharing_rounds);
    # the median round's ratio counts, so a burst of the host's other load in one round does not move it
    sharing_rounds: int = 3


def profile_steps(control: ControlPlane, stage: StageInfo, request: dict, probe_bytes: int,
                  config: ProfilingConfig) -> Steps[StageProfile]:
    """The conversation that profiles one stage (broker/waits.py): it times itself at the request's shapes,
    then the control thread times its link with echoes. NoReply when it cannot profile itself or answer."""
    started = time.monotonic()
    control.send(stage, protocol.PROFILE, **request)
    result = yield Reply(stage, protocol.PROFILE_RESULT, config.timeout_s)
    if "error" in result:
        raise NoReply(stage, f"could not profile itself: {result['error']}")
    token = control.time_link(stage, probe_bytes, config.probe_rounds)
    timed = yield Reply(stage, LINK_TIMED, ECHO_TIMEOUT_S * (2 * config.probe_rounds + 1),
                        accept=lambda header: header.get("token") == token)
    if "error" in timed:
        raise NoReply(stage, f"its link could not be timed: {timed['error']}")
    bandwidth, latency = float(timed["bytes_per_s"]), float(timed["latency_s"])
    profile = profile_from_result(result, stage.name, stage.device, stage.host, stage.threads, request["kv_length"],
                                  bandwidth, latency)
    log.info("stage %s profile (%s, %.1f s): layer %.2f ms/decode step, %.2f ms/prefill chunk, head %.2f ms, "
             "budget %s, link %.0f MB/s + %.0f us", stage.name,
             "cached" if result.get("cached") else "measured", time.monotonic() - started,
             1000 * profile.layer_decode_s, 1000 * profile.layer_prefill_s, 1000 * profile.head_s,
             budget_breakdown(result), bandwidth / 1e6, 1e6 * latency)
    return profile


def probe_bytes_of(model: ModelMemory, micro_batch_size: int, max_step_tokens: int) -> int:
    """The payload of a link probe: one step's activations, within a control message's limit."""
    return min(MAX_PROBE_BYTES, (micro_batch_size + max_step_tokens) * model.activation_bytes_per_token)


def collect_profiles(control: ControlPlane, stages: list[StageInfo], model_dir: str, model: ModelMemory,
                     micro_batch_size: int, max_step_tokens: int, max_context: int,
                     config: ProfilingConfig = ProfilingConfig(), weights: str = "auto",
                     liveness: Liveness = Liveness(5.0, 300.0)) -> list[StageProfile]:
    """One StageProfile per stage, in the order given, each timed in its weight format (its own
    --weights, else `weights`, the broker's), one stage after another. With config.probe_s > 0 the stages
    that share a machine are probed together (`measure_sharing`) among themselves: a broker adding stages
    to ones it profiled before probes the whole group instead (Broker.profile)."""
    request = profile_request(model_dir, micro_batch_size, max_step_tokens, max_context, config, weights)
    probe_bytes = probe_bytes_of(model, micro_batch_size, max_step_tokens)
    profiles = [run_blocking(control, profile_steps(control, stage, request, probe_bytes, config), liveness)
                for stage in stages]
    if config.probe_s > 0:
        profiles = measure_sharing(control, stages, profiles, request, config.probe_s, config.timeout_s,
                                   rounds=config.sharing_rounds, tick_layers=tick_layers_of(model, len(stages)),
                                   liveness=liveness)
    return profiles


def tick_layers_of(model: ModelMemory, stages: int) -> int:
    """Layers a stage holds in an even split: what the probe in step runs, so its steps are as long as real ones."""
    return max(1, round(model.num_layers / max(1, stages)))


def profile_request(model_dir: str, micro_batch_size: int, max_step_tokens: int, max_context: int,
                    config: ProfilingConfig, weights: str) -> dict:
    """The PROFILE message's fields: the shapes the stages are timed (and co-run probed) at."""
    return {"model_dir": model_dir, "micro_batch_size": micro_batch_size,
            "kv_length": config.kv_length or min(256, max_context // 2), "prefill_tokens": max_step_tokens,
            "weights": weights}


def _bytes(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def budget_breakdown(result: dict) -> str:
    """The stage's budget as the planner gets it, with what came out of it first (stages/profile.py
    memory_figures): "1.52 GiB (of --memory-budget 2.00 GiB: runtime 0.41 GiB, loader 0.07 GiB)"."""
    usable = f"{int(result['memory_budget']) / 2**30:.2f} GiB"
    given, runtime, loader = (result.get(k) for k in ("memory_budget_given", "runtime_bytes", "loader_peak_bytes"))
    if result.get("emulated_memory"):
        return f"{usable} (emulated)"
    if not isinstance(loader, int):
        return usable  # a stage of an older version
    parts = f"runtime {int(runtime or 0) / 2**30:.2f} GiB, " if given is not None and runtime else ""
    parts += f"loader {loader / 2**30:.2f} GiB"
    source = f"--memory-budget {int(given) / 2**30:.2f} GiB" if given is not None else "free memory"
    return f"{usable} (of {source}: {parts})"


def measure_sharing(control: ControlPlane, stages: list[StageInfo], profiles: list[StageProfile], request: dict,
                    probe_s: float, timeout_s: float, cache_dir: Path | None = None,
                    rounds: int = ProfilingConfig.sharing_rounds, tick_layers: int = 0,
                    liveness: Liveness = Liveness(5.0, 300.0)) -> list[StageProfile]:
    """Each profile with its `corun_factor`: for the CPU stages of each machine that runs more than
    one, the decode step served by each alone, then by all at once; the ratio is what sharing the
    machine costs it (cores, memory bandwidth, whatever else runs there). In `rounds` rounds of
    `probe_s / rounds` per probe, and the median round's ratio counts: on this shared 2-core VM one
    probe of 1.5 s read 1.45x for an emulated stage that read 1.00-1.03x in the plans before and after, and the
    plan that followed put 28 of 30 layers on the other stage. Like the profiles, the factors are
    cached (`sharing_cache_key`): a restart on the same machine with the same stages does not probe
    again (it cost 5 to 8 s before every run of two or three local stages).

    With `tick_layers` (a stage's share of the model's layers), each round also runs the probe in step
    (`_ticks_round`): every stage of the host starts each step at the same tick, as a ring of one
    micro-batch per stage starts them, each step as long as a real one. The ring waits for the last
    stage to finish, and a host with fewer cores than stages finishes them unevenly: the host's
    `lockstep_excess_s` is how much longer a tick lasted than the slowest stage at its own pace (the
    co-run factor's) would take, per step (bench/bench_cosched.py: 1.65x alone where the factor said 1.5x)."""
    by_name = {p.name: p for p in profiles}
    hosts: dict[str, list[StageInfo]] = {}
    for stage in stages:
        if stage.name in by_name and by_name[stage.name].shares_cores:
            hosts.setdefault(stage.host, []).append(stage)
    factors: dict[str, float] = {}
    excess: dict[str, float] = {}
    rounds = max(1, rounds)
    probe = dict(request, probe_s=probe_s / rounds)
    for host, group in hosts.items():
        if len(group) < 2:
            continue
        group = sorted(group, key=lambda stage: _stage_setup(stage, by_name[stage.name]))
        key = sharing_cache_key(host, [_stage_setup(stage, by_name[stage.name]) for stage in group],
                                dict(probe, rounds=rounds, tick_layers=tick_layers))
        path = (cache_dir or profile_cache_dir()) / f"corun-{_digest(key)}.json"
        cached = _read_factors(path, key, len(group))
        setups = {stage.name: json.dumps(_stage_setup(stage, by_name[stage.name])) for stage in group}
        if cached is not None:
            factors.update(even_factors({stage.name: factor for stage, factor in zip(group, cached[0])}, setups))
            host_excess = cached[1]
        else:
            ratios: dict[str, list[float]] = {stage.name: [] for stage in group}
            tick_rounds = []
            for _ in range(rounds):
                alone, ready = {}, []
                for stage in group:
                    control.send(stage, protocol.PROFILE, **probe)
                    result = _probe_results(control, [stage], timeout_s, liveness, field="probe_step_s",
                                            whole=True)[stage.name]
                    alone[stage.name] = float(result["probe_step_s"]) if result else None
                    ready.append(result.get("probe_ready_s") if result else None)
                lead = _lead_s(ready)
                start = time.time() + lead  # all at once: each loads its layers first, at its own speed
                for stage in group:
                    control.send(stage, protocol.PROFILE, **probe, probe_start=start, start_lead_s=lead)
                together = _probe_results(control, group, timeout_s + lead, liveness)
                for stage in group:
                    if alone[stage.name] and together.get(stage.name):
                        ratios[stage.name].append(together[stage.name] / alone[stage.name])
                if tick_layers and all(alone.values()):
                    tick_rounds.append((alone, _ticks_round(control, group, [by_name[g.name] for g in group], probe,
                                                            tick_layers, timeout_s, liveness, lead)))
            for name, measured in ratios.items():
                if len(measured) == rounds:  # a stage that could not probe in some round: reckoned from threads
                    factors[name] = max(1.0, statistics.median(measured))
            factors.update(even_factors({stage.name: factors[stage.name] for stage in group if stage.name in factors},
                                        setups))
            host_excess = lockstep_excess_s(tick_rounds, factors) if tick_rounds else 0.0
            if all(stage.name in factors for stage in group):  # a stage that could not probe: ask again next time
                _write_factors(path, key, [factors[stage.name] for stage in group], host_excess)
        excess.update({stage.name: host_excess for stage in group if stage.name in factors})
        names = {stage.name for stage in group}
        log.info("stages sharing %s (%s): step time together / alone %s; in step, %.1f ms a step more", host,
                 "cached" if cached is not None else "measured",
                 ", ".join(f"{name} {factors[name]:.2f}x" for name in sorted(factors) if name in names) or "not measured",
                 1000 * host_excess)
    return [replace(p, corun_factor=factors[p.name], lockstep_excess_s=excess.get(p.name, 0.0))
            if p.name in factors else p for p in profiles]


def _lead_s(ready: list) -> float:
    """How long before a start in common to send the stages their probes: twice the longest any took alone
    from the request to its first step served (together they load at once, sharing the cores), plus 50 ms;
    UNKNOWN_LEAD_S where a stage did not say (a stage of before). 0.4 s before every probe served together,
    where a tiny model's stages are ready in milliseconds, added seconds to each test that plans local
    stages (the fresh-clone suite ran 45 s faster without it, within this machine's noise)."""
    if not ready or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r < 60 for r in ready):
        return UNKNOWN_LEAD_S
    return 0.05 + 2 * max(ready)


def _ticks_round(control: ControlPlane, group: list[StageInfo], profiles: list[StageProfile], probe: dict,
                 tick_layers: int, timeout_s: float, liveness: Liveness,
                 lead_s: float = UNKNOWN_LEAD_S) -> dict[str, dict]:
    """The probe in step on every stage of one host: {stage: its result (its steps per tick, the held
    step's repeats)}. The ticks are far enough apart for every stage to finish before the next: the
    slowest step as the profiles price it, times what the host's cores could stretch it by."""
    step = max(p.step_overhead_s + p.layer_decode_s * tick_layers for p in profiles)
    cores = max(1, min(p.host_cores or len(group) for p in profiles))
    period = step * (1 + len(group) / cores) + 0.005
    lead_s += step  # each stage loads its layers and warms up (a real step's length) first
    start = time.time() + lead_s
    for stage in group:
        control.send(stage, protocol.PROFILE, **probe, tick_start=start, tick_period_s=period, tick_layers=tick_layers,
                     start_lead_s=lead_s)
    return _probe_results(control, group, timeout_s + lead_s, liveness, field="probe_ticks", whole=True)


def lockstep_excess_s(rounds: list[tuple[dict[str, float], dict[str, dict | None]]], factors: dict[str, float]) -> float:
    """Per step, how much longer the host's stages took started in step than the slowest of them at its
    own pace: per tick every stage started, the last to finish, less the slowest stage's step alone times
    its co-run factor (what the plan already prices); the median tick of each round, the median round.
    `rounds`: per round, each stage's step alone (the held layers once) and its result in step. 0 when
    no tick had every stage (the plan then prices the ring as the factors say)."""
    medians = []
    for alone, results in rounds:
        if not all(results.get(name) for name in alone) or not all(name in factors for name in alone):
            continue
        steps = {name: dict((int(tick), float(took)) for tick, took in results[name]["probe_ticks"]) for name in alone}
        paced = max(alone[name] * int(results[name]["probe_tick_repeats"]) * factors[name] for name in alone)
        shared = set.intersection(*(set(by_tick) for by_tick in steps.values()))
        excesses = [max(by_tick[tick] for by_tick in steps.values()) - paced for tick in sorted(shared)]
        if excesses:
            medians.append(statistics.median(excesses))
    return max(0.0, statistics.median(medians)) if medians else 0.0


def even_factors(factors: dict[str, float], setups: dict[str, str]) -> dict[str, float]:
    """Each stage's factor, the mean of its setup's: stages set up alike on one host share it alike, and
    one short probe splits them unevenly (three single-thread stages on two cores measured 1.00x, 1.00x
    and 1.76x: the planner then gave the third 2 layers of 30). The cache, keyed by setups, could not
    tell alike stages apart anyway."""
    alike: dict[str, list[float]] = {}
    for name, factor in factors.items():
        alike.setdefault(setups[name], []).append(factor)
    return {name: sum(alike[setups[name]]) / len(alike[setups[name]]) for name in factors}


def _stage_setup(stage: StageInfo, profile: StageProfile) -> list:
    """What a stage's share of a co-run probe depends on, besides the host and the probe itself."""
    return [stage.device, stage.dtype, stage.threads, round(profile.compute_share, 6), stage.own_weights or ""]


def sharing_cache_key(host: str, setups: list[list], probe: dict) -> dict:
    """The co-run cache key: the host, every co-located stage's setup in a fixed order, the probe's
    shapes and duration (the model included), the OpenMP wait policy and the torch version that ran it."""
    return {"version": SHARING_CACHE_VERSION, "host": host, "stages": setups, "probe": probe,
            "openmp_wait_policy": wait_policy(), "torch": torch.__version__}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _read_factors(path: Path, key: dict, count: int) -> tuple[list[float], float] | None:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none yet, or unreadable: probe again
    if not isinstance(stored, dict):
        return None
    factors = stored.get("factors")
    if stored.get("key") != key or not isinstance(factors, list) or len(factors) != count:
        return None
    if not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 1.0 <= f < 1e6 for f in factors):
        return None
    excess = stored.get("lockstep_excess_s", 0.0)
    if not isinstance(excess, (int, float)) or isinstance(excess, bool) or not 0 <= excess < 60:
        return None
    return [float(f) for f in factors], float(excess)


def _write_factors(path: Path, key: dict, factors: list[float], lockstep_excess: float = 0.0) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"key": key, "factors": factors, "lockstep_excess_s": lockstep_excess,
                                         "measured_at": time.time()}, indent=1))
        os.replace(temporary, path)  # concurrent writers each rename a whole file
    except OSError as error:
        log.warning("could not cache the co-run factors in %s (%s); the next plan probes again", path, error)


def _probe_results(control: ControlPlane, stages: list[StageInfo], timeout_s: float, liveness: Liveness,
                   field: str = "probe_step_s", whole: bool = False) -> dict:
    """Every stage's probe result, gathered as they come: its step time, or (`whole`) the result with `field`
    in it; None where it could not run the probe. A stage lost meanwhile raises StageLost."""
    def gather() -> Steps[dict]:
        results: dict = {}
        deadline = time.monotonic() + timeout_s
        for stage in stages:
            header = yield Reply(stage, protocol.PROFILE_RESULT, max(0.1, deadline - time.monotonic()))
            if field in header:
                results[stage.name] = header if whole else float(header[field])
            else:
                log.warning("stage %s could not run the co-run probe: %s", stage.name,
                            header.get("error", "no step time"))
                results[stage.name] = None
        return results

    return run_blocking(control, gather(), liveness)


def profile_from_result(result: dict, name: str, device: str, host: str, threads: int, kv_length: int,
                        bandwidth: float = math.inf, latency: float = 0.0) -> StageProfile:
    """The planner's profile from a stage's PROFILE_RESULT: the scalars it reports, plus the costs
    fitted from its timed shapes (planner.step_cost) when it reports them (a stage of this version)."""
    rows, chunk = int(result["micro_batch_size"]), int(result["prefill_tokens"])
    layer = overhead = None
    head_step = 0.0
    if all(f"{shape}_per_layer_s" in result for shape in PROFILE_SHAPES):
        few, long_kv, late = int(result["few_rows"]), int(result["long_kv_length"]), int(result["late_start"])
        works = {"decode": decode_step(rows, kv_length), "few_rows": decode_step(few, kv_length),
                 "long_kv": decode_step(rows, long_kv), "prefill": prefill_step(chunk),
                 "late_prefill": prefill_step(chunk, late)}
        points = [ProfilePoint(works[shape], float(result[f"{shape}_one_layer_s"]),
                               float(result[f"{shape}_per_layer_s"])) for shape in PROFILE_SHAPES]
        layer, overhead = fit_costs(*points)
        if few < rows:  # the head reads its weights once per step whatever the rows: its fixed part
            per_row = max(0.0, (float(result["head_s"]) - float(result["head_few_rows_s"])) / (rows - few))
            head_step = max(0.0, float(result["head_s"]) - per_row * rows)
    speed = float(result.get("emulate_speed", 1.0))
    weights_profiled = str(result.get("weights_profiled", "auto"))
    format_costs = (format_layer_costs(result.get("format_ratios"), layer, decode_step(rows, kv_length),
                                       prefill_step(chunk)) if weights_profiled == "auto" else ())
    return StageProfile(
        name=name, layer_decode_s=float(result["layer_decode_s"]), layer_prefill_s=float(result["layer_prefill_s"]),
        embed_s=float(result["embed_s"]), head_s=float(result["head_s"]),
        step_overhead_s=float(result.get("step_overhead_s", 0.0)), memory_budget=int(result["memory_budget"]),
        runtime_bytes=_bytes(result.get("runtime_bytes")), loader_bytes=_bytes(result.get("loader_peak_bytes")),
        link_bandwidth=bandwidth, link_latency_s=latency, micro_batch_size=rows, prefill_tokens=chunk, device=device,
        layer_cost=layer, overhead_cost=overhead, head_step_s=head_step, host=host,
        host_cores=int(result.get("host_cores", 0)), threads=threads, compute_share=min(1.0, max(speed, 1e-6)),
        format_layer_costs=format_costs, weights_profiled=weights_profiled)


def format_layer_costs(ratios, layer: LinearCost | None, decode: StepWork,
                       prefill: StepWork) -> tuple[tuple[str, LinearCost], ...]:
    """A full-precision profile's layer cost in each quantized format it timed (stages/profile.py
    measure_format_ratios: that format's time over full precision's for the `decode` and the `prefill`
    step). Weights change the matmuls, not attention over the cache: the per-pass and per-row parts are
    scaled so the decode step takes its measured ratio, then the per-token part so the prefill chunk
    does; the KV and context parts stay. () for a stage of an older version or an unfitted profile:
    the planner then prices every format as full precision."""
    if layer is None or not isinstance(ratios, dict):
        return ()
    costs = []
    for name, shapes in sorted(ratios.items()):
        decode_ratio, prefill_ratio = (shapes.get(k) if isinstance(shapes, dict) else None
                                       for k in ("decode", "prefill"))
        if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r < 1e3
                   for r in (decode_ratio, prefill_ratio)):
            continue
        weights_d = layer.per_step_s * decode.steps + layer.per_pass_s * decode.passes + layer.per_row_s * decode.decode_rows
        kv_d = layer.per_row_kv_s * decode.decode_kv
        scale_d = _part_scale(decode_ratio * (weights_d + kv_d) - kv_d, weights_d, decode_ratio)
        passes_p = layer.per_step_s * prefill.steps + layer.per_pass_s * prefill.passes
        tokens_p = layer.per_token_s * prefill.prefill_tokens
        ctx_p = layer.per_token_ctx_s * prefill.prefill_ctx
        scale_p = _part_scale(prefill_ratio * (passes_p + tokens_p + ctx_p) - scale_d * passes_p - ctx_p, tokens_p,
                              prefill_ratio)
        costs.append((str(name), LinearCost(per_step_s=layer.per_step_s * scale_d, per_pass_s=layer.per_pass_s * scale_d,
                                            per_row_s=layer.per_row_s * scale_d, per_row_kv_s=layer.per_row_kv_s,
                                            per_token_s=layer.per_token_s * scale_p,
                                            per_token_ctx_s=layer.per_token_ctx_s)))
    return tuple(costs)


def _part_scale(wanted_s: float, part_s: float, whole_ratio: float) -> float:
    """What a part costing `part_s` must be scaled by to cost `wanted_s`; the whole step's ratio where
    the part is too small to carry it (noise), never below a tenth of it."""
    if part_s <= 0 or wanted_s <= 0:
        return whole_ratio
    return max(wanted_s / part_s, whole_ratio / 10)
