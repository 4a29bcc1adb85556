"""What the broker asks a stage to measure (the PROFILE message), and the shapes a profile times.

A request is either a profile (the serving code timed at a few step shapes: stages.profile) or a
co-run probe (the decode step served for a while, alone, beside the host's other stages, or in step
with them: stages.corun_probe). `ProfileRequest.from_header` refuses a malformed one before anything loads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from layerbus.wire import protocol
from layerbus.wire.frames import WireError
from layerbus.wire.weight_formats import WEIGHT_FORMATS

# Each shape is timed with one layer and with PROFILE_LAYERS: "<shape>_one_layer_s" is overhead + one
# layer, "<shape>_per_layer_s" what each further layer adds. decode: the requested rows at the requested
# KV length; few_rows: a quarter of the rows; long_kv: a longer KV length; prefill: one chunk from
# position 0; late_prefill: the same chunk after `late_start` cached positions. The broker fits a
# fixed + per-row + per-position cost from them (planner.step_cost.fit_costs).
PROFILE_LAYERS = 4  # timed with one layer and with this many: the difference is the per-layer cost
SHAPES = ("decode", "few_rows", "long_kv", "prefill", "late_prefill")
TIMING_FIELDS = ("layer_decode_s", "layer_prefill_s", "embed_s", "head_s", "step_overhead_s", "head_few_rows_s",
                 *(f"{shape}_{part}" for shape in SHAPES for part in ("one_layer_s", "per_layer_s")))
MIN_TICK_PERIOD_S = 0.001
MAX_START_AHEAD_S = 60.0  # a start further ahead than this on the stage's clock is refused, not waited for


@dataclass(frozen=True)
class ProfileRequest:
    """What the broker asks a stage to measure (the PROFILE message's fields)."""

    model_dir: str  # the model to time (its first layers, embedding and head)
    micro_batch_size: int  # decode rows per step
    kv_length: int  # cached tokens each decode row attends over (a representative length)
    prefill_tokens: int  # tokens of one prefill chunk
    # > 0: not a profile but a co-run probe: serve the decode step for this many seconds (stages.corun_probe)
    probe_s: float = 0.0
    # A co-run probe in step (tick_period_s > 0): each step starts at tick_start + k * tick_period_s on the
    # host's wall clock, as every stage of the host is, and runs the held layers over and over to about
    # `tick_layers` layers (a stage's share of the model: the length of a real step). See `corun_probe.tick_probe`.
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
