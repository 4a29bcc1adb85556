"""What a network link costs a pipeline, from what was measured on it: pure arithmetic, no sockets.

`layerbus netprobe` measures round trips and bandwidth (wire/link_probe.py) and turns them into
these figures; a link matrix between stages can reuse the same functions.

The model of one link, for one decode step of a micro-batch of `rows` sequences:
  link_s      = one-way latency + step bytes / bandwidth: how long each step spends on the link,
                so what every sequence in the micro-batch waits there for each new token
  per token   = link_s / rows: the link's cost per generated token when nothing overlaps it
                (batching amortizes it: the seed's "batching amortizes it")
  link cap    = rows / transfer_s: tokens/s at which the link is busy all the time; no schedule
                gets more through it
  in flight   = ceil(round trip / compute_s) micro-batches for a chain of S stages never to wait,
                where one micro-batch's round trip is S x compute_s + (S - 1) x link_s (the links
                that carry hidden states) + 2 one-way latencies (the broker's links, which carry
                token ids only): S on a network that costs nothing, more as its links cost more.
                Only while transfer_s <= compute_s: otherwise the link, not the compute, sets the
                pace, and no number of micro-batches hides it
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RoundTrips:
    """Summary of echo round-trip times, seconds."""

    count: int
    min_s: float
    median_s: float
    p99_s: float  # nearest rank: with fewer than 100 samples, the largest

    @property
    def one_way_s(self) -> float:
        """Latency one way: half the median round trip (the usual symmetric-link assumption)."""
        return self.median_s / 2


def round_trips(samples: Sequence[float]) -> RoundTrips:
    """min / median / p99 of round-trip samples (seconds); ValueError on none or a negative one."""
    if not samples:
        raise ValueError("no round trips measured: need at least one echo")
    if min(samples) < 0:
        raise ValueError(f"a round trip cannot take negative time, got {min(samples)} s (is the clock monotonic?)")
    ordered = sorted(samples)
    rank = math.ceil(0.99 * len(ordered))  # nearest-rank percentile: an observed value, never interpolated
    return RoundTrips(len(ordered), ordered[0], statistics.median(ordered), ordered[rank - 1])


def bandwidth(bytes_sent: int, elapsed_s: float, round_trip_s: float) -> float:
    """Bytes/s of a burst timed from its first send to the peer's acknowledgement of its last
    message: the elapsed time holds the transfer plus one round trip (the first byte's way there,
    the acknowledgement's way back), which is taken off. At least 1% of the elapsed time counts as
    transfer, so a burst no longer than the round trip still gives a finite, very high figure."""
    if bytes_sent <= 0 or elapsed_s <= 0:
        raise ValueError(f"need bytes_sent > 0 and elapsed_s > 0, got {bytes_sent} B in {elapsed_s} s")
    transfer = max(elapsed_s - max(round_trip_s, 0.0), 0.01 * elapsed_s)
    return bytes_sent / transfer


def next_burst(messages: int, elapsed_s: float, target_s: float, max_growth: int = 8) -> int:
    """Messages in the next burst, to last about `target_s` (with a 20% margin) after one of
    `messages` took `elapsed_s`; it grows at most `max_growth` times per round, since a short
    burst's time is mostly the round trip and says little about bandwidth."""
    if elapsed_s <= 0:
        return messages * max_growth
    wanted = math.ceil(messages * 1.2 * target_s / elapsed_s)
    return max(messages + 1, min(wanted, messages * max_growth))


@dataclass(frozen=True)
class LinkCost:
    """What one link adds to a decode step of `rows` sequences (see the module docstring)."""

    step_bytes: int  # one step's message: header and tensor frames
    rows: int  # sequences in the micro-batch: each gets one new token per step
    one_way_s: float  # latency one way
    transfer_s: float  # step_bytes / bandwidth
    link_s: float  # one_way_s + transfer_s
    per_token_s: float  # link_s / rows
    tokens_per_s_cap: float  # rows / transfer_s

    def to_json(self) -> dict:
        return {"step_bytes": self.step_bytes, "rows": self.rows, "transfer_ms": self.transfer_s * 1e3,
                "link_step_ms": self.link_s * 1e3, "per_token_ms": self.per_token_s * 1e3,
                "tokens_per_s_cap": self.tokens_per_s_cap}


def link_cost(step_bytes: int, rows: int, bandwidth_bytes_per_s: float, one_way_s: float) -> LinkCost:
    """The cost of sending one step's message of `step_bytes` for `rows` sequences over a link of
    this bandwidth and one-way latency."""
    if step_bytes < 0 or rows < 1 or not bandwidth_bytes_per_s > 0 or one_way_s < 0:
        raise ValueError(f"need step_bytes >= 0, rows >= 1, bandwidth > 0 and latency >= 0, got {step_bytes} B, "
                         f"{rows} rows, {bandwidth_bytes_per_s} B/s, {one_way_s} s")
    transfer = step_bytes / bandwidth_bytes_per_s
    link = one_way_s + transfer
    return LinkCost(step_bytes, rows, one_way_s, transfer, link, link / rows,
                    rows / transfer if transfer > 0 else math.inf)


def micro_batches_in_flight(stages: int, link: LinkCost, compute_s: float) -> int | None:
    """Micro-batches a chain of `stages` stages, each computing `compute_s` per step and joined by
    links like `link`, needs in flight for no stage to wait (the module docstring's round trip);
    None when the link's transfer alone outlasts the compute, so that nothing hides it."""
    if stages < 1 or not compute_s > 0:
        raise ValueError(f"need stages >= 1 and a step compute time > 0 s, got {stages} stages, {compute_s} s")
    if link.transfer_s > compute_s:
        return None
    round_trip = stages * compute_s + (stages - 1) * link.link_s + 2 * link.one_way_s
    return math.ceil(round_trip / compute_s - 1e-9)  # a hair of slack: S x C / C is S, not S + 1


def mbit_per_s(bytes_per_s: float) -> float:
    """Bytes/s as Mbit/s (10^6 bits), the unit of `tc ... rate` and of `--link-mbps`."""
    return bytes_per_s * 8 / 1e6
