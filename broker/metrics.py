"""The broker's Prometheus metrics as plain values: what a scrape shows, computed from the broker's
state (its stages as the heartbeats left them, the placement in use, its counters) and the jobs' status
in the store, at the moment of the scrape. Pure: no sockets, no clock, no prometheus_client (the
server, broker.metrics_server, turns these values into its families), so every figure is table-testable.

Names follow Prometheus's conventions: base units (`_seconds`, `_bytes`), `_total` on counters, a
`stage` label on what one stage reports and a `job_id` label on what one job did (not `job`: Prometheus
gives every scraped series a `job` label of its own, the scrape config's name, and would rename ours)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from layerbus.planner.chain import Placement
from layerbus.broker.control import StageInfo, StageState
from layerbus.broker.run_state import BrokerCounts
from layerbus.storage.records import JobStatus
from layerbus.storage.states import ITEM_STATES, JOB_STATES

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Sample:
    """One series of a family: its labels and value."""

    labels: Labels
    value: float


@dataclass(frozen=True)
class HistogramSample:
    """One histogram series: cumulative counts per upper bound (the last bound is +Inf) and their sum."""

    labels: Labels
    buckets: tuple[tuple[float, int], ...]  # (upper bound, observations <= it), +Inf last
    total: float  # the sum of the observed values


@dataclass(frozen=True)
class Family:
    """One metric: its name as exposed (counters end in _total), kind, help and series."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    samples: tuple[Sample, ...] | tuple[HistogramSample, ...]


@dataclass(frozen=True)
class BusySample:
    """A stage's busy time against its uptime, both on the stage's own clock, as one heartbeat said."""

    uptime_s: float
    busy_s: float


BUSY_WINDOW_S = 60.0  # layerbus_stage_busy_ratio covers about the last minute of each stage's time


def busy_ratio(history: Sequence[BusySample], now: BusySample, window_s: float = BUSY_WINDOW_S) -> float:
    """The fraction of its time the stage spent in steps over about the last `window_s` of its uptime, in
    [0, 1]: since the latest sample of `history` at least `window_s` old; over its whole life when it is
    younger than the window; else (scrapes began less than a window ago) since the oldest sample there is."""
    earlier = [s for s in history if s.uptime_s < now.uptime_s]
    old_enough = [s for s in earlier if s.uptime_s <= now.uptime_s - window_s]
    if old_enough:
        base = old_enough[-1]
    elif now.uptime_s <= window_s or not earlier:
        base = BusySample(0.0, 0.0)
    else:
        base = earlier[0]
    span = now.uptime_s - base.uptime_s
    if span <= 0:
        return 0.0
    return min(1.0, max(0.0, (now.busy_s - base.busy_s) / span))


def remember(history: Sequence[BusySample], now: BusySample,
             window_s: float = BUSY_WINDOW_S) -> tuple[BusySample, ...]:
    """`history` with `now` added, keeping the samples within the window and the latest one before it (the
    next ratio's base). A stage whose uptime went back is a new process under the same name: its old
    samples are forgotten."""
    if history and now.uptime_s < history[-1].uptime_s:
        history = ()
    before = [s for s in history if s.uptime_s < now.uptime_s - window_s]
    kept = tuple(before[-1:]) + tuple(s for s in history if s.uptime_s >= now.uptime_s - window_s)
    return kept if kept and kept[-1].uptime_s == now.uptime_s else kept + (now,)


def busy_sample(stats: Mapping) -> BusySample | None:
    """The busy sample of a stage's last reported stats; None before its first heartbeat."""
    if "uptime_s" not in stats:
        return None
    return BusySample(_number(stats.get("uptime_s")), _number(stats.get("busy_s")))


def chain_ready(stages: Sequence[StageInfo], placement: Placement | None) -> bool:
    """Ready to serve (/healthz's 200): a chain is placed and every stage of it has loaded its span."""
    if placement is None:
        return False
    by_name = {stage.name: stage for stage in stages}
    return all(name in by_name and by_name[name].state is StageState.READY for name in placement.stages)


def stage_families(stages: Sequence[StageInfo], placement: Placement | None, now: float,
                   ratios: Mapping[str, float]) -> list[Family]:
    """Per registered stage: what it is and serves, its state, heartbeat age, busy ratio (`ratios`,
    from busy_ratio), step time histogram, link bytes and memory. `now` is the control plane's clock."""
    info, states, age, busy, busy_total, tokens, sent, received = [], [], [], [], [], [], [], []
    rejected, used, peak, budget, weight, steps = [], [], [], [], [], []
    for stage in stages:
        stats = stage.stats
        own = (("stage", stage.name),)
        info.append(Sample(own + _placed_labels(stage, placement) + (
            ("host", stage.host), ("device", stage.device), ("dtype", stage.dtype), ("weights", stage.weights)), 1))
        states.extend(Sample(own + (("state", state.value),), float(stage.state is state)) for state in StageState)
        age.append(Sample(own, max(0.0, now - stage.last_seen)))
        if stage.name in ratios:
            busy.append(Sample(own, ratios[stage.name]))
        busy_total.append(Sample(own, _number(stats.get("busy_s"))))
        tokens.append(Sample(own, _number(stats.get("tokens"))))
        sent.append(Sample(own, _number(stats.get("bytes_out"))))
        received.append(Sample(own, _number(stats.get("bytes_in"))))
        rejected.append(Sample(own, _number(stats.get("rejected"))))
        used.append(Sample(own + (("memory", "host"),), _number(stats.get("rss_bytes"))))
        if stage.device != "cpu":
            used.append(Sample(own + (("memory", "device"),), _number(stats.get("device_bytes"))))
        peak.append(Sample(own, _number(stats.get("peak_rss"))))
        if stage.memory_budget is not None:
            budget.append(Sample(own, float(stage.memory_budget)))
        weight.append(Sample(own, float(stage.param_bytes)))
        histogram = step_histogram(stats)
        if histogram is not None:
            steps.append(HistogramSample(own, *histogram))
    return [
        Family("layerbus_stage_info", "gauge", "Each registered stage: its chain position, layers [start, end), "
               "the codec of its outgoing link, host, device, dtype and weight format (value 1).", tuple(info)),
        Family("layerbus_stage_state", "gauge", "Each stage's state as the broker sees it (1 for the state it is "
               "in, 0 for the others).", tuple(states)),
        Family("layerbus_stage_heartbeat_age_seconds", "gauge", "Seconds since anything last arrived from the "
               "stage (it heartbeats every 0.5 s).", tuple(age)),
        Family("layerbus_stage_busy_ratio", "gauge", "Fraction of the stage's time spent running steps, over "
               f"about the last {BUSY_WINDOW_S:g} s.", tuple(busy)),
        Family("layerbus_stage_busy_seconds_total", "counter", "Seconds the stage spent running steps.",
               tuple(busy_total)),
        Family("layerbus_stage_step_seconds", "histogram", "Time the stage took per step: receive, decode, "
               "compute, encode, send.", tuple(steps)),
        Family("layerbus_stage_tokens_total", "counter", "Positions the stage ran through its layers.",
               tuple(tokens)),
        Family("layerbus_stage_sent_bytes_total", "counter", "Tensor bytes the stage sent to its next hop.",
               tuple(sent)),
        Family("layerbus_stage_received_bytes_total", "counter", "Tensor bytes the stage received from the hop "
               "before it.", tuple(received)),
        Family("layerbus_stage_rejected_messages_total", "counter", "Malformed or unexpected messages the stage "
               "rejected.", tuple(rejected)),
        Family("layerbus_stage_memory_used_bytes", "gauge", "The stage's memory: resident in RAM (memory=host) "
               "and reserved on its GPU (memory=device).", tuple(used)),
        Family("layerbus_stage_memory_peak_bytes", "gauge", "The stage process's peak resident memory.",
               tuple(peak)),
        Family("layerbus_stage_memory_budget_bytes", "gauge", "The stage's --memory-budget (absent when not "
               "given: the memory free when it profiled).", tuple(budget)),
        Family("layerbus_stage_weight_bytes", "gauge", "Bytes of the weights the stage holds.", tuple(weight)),
    ]


def step_histogram(stats: Mapping) -> tuple[tuple[tuple[float, int], ...], float] | None:
    """The stage's step-time histogram as cumulative (bound, count) pairs ending in +Inf, and its sum
    (busy_s); None when its stats carry none or a malformed one (an older stage, a bad report)."""
    bounds, counts = stats.get("step_le"), stats.get("step_counts")
    if not isinstance(bounds, list) or not isinstance(counts, list) or len(counts) != len(bounds) + 1:
        return None
    if not all(_finite(b) for b in bounds) or any(b >= c for b, c in zip(bounds, bounds[1:])):
        return None
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return None
    cumulative, running = [], 0
    for bound, count in zip([*bounds, math.inf], counts):
        running += count
        cumulative.append((float(bound), running))
    return tuple(cumulative), _number(stats.get("busy_s"))


def counter_families(counts: BrokerCounts, ready: bool, epoch: int) -> list[Family]:
    """What the broker has been through since it started, and whether its chain is ready now."""
    return [
        Family("layerbus_chain_ready", "gauge", "1 when a chain is placed and every stage of it has loaded its "
               "span (/healthz answers 200), else 0.", (Sample((), float(ready)),)),
        Family("layerbus_placement_epoch", "gauge", "How many times spans were assigned (each placement and "
               "re-plan is one more).", (Sample((), float(epoch)),)),
        Family("layerbus_stages_lost_total", "counter", "Stages declared lost (silent, stuck, gone or failed).",
               (Sample((), counts.stages_lost),)),
        Family("layerbus_replans_total", "counter", "Placements made again: without a lost stage (reason=lost), "
               "to move layers off a slowed one (reason=slowed) or to put stages that joined to work (reason=joined).",
               (Sample((("reason", "lost"),), counts.replans_lost),
                Sample((("reason", "slowed"),), counts.replans_slowed),
                Sample((("reason", "joined"),), counts.replans_joined))),
        Family("layerbus_failed_steps_total", "counter", "Steps a stage reported failed (their items are retried "
               "alone, then fail).", (Sample((), counts.failed_steps),)),
        Family("layerbus_step_retries_total", "counter", "Steps sent again: not back in time, or the next hop "
               "could not be reached.", (Sample((), counts.resent_steps),)),
        Family("layerbus_draft_tokens_total", "counter", "Draft tokens sent for the last stage to verify "
               "(state=proposed) and those it accepted (state=accepted).",
               (Sample((("state", "proposed"),), counts.drafts_proposed),
                Sample((("state", "accepted"),), counts.drafts_accepted))),
        Family("layerbus_decode_trips_total", "counter", "Decode rows sent down the chain; with "
               "layerbus_decode_trip_tokens_total, the tokens per trip.", (Sample((), counts.decode_trips),)),
        Family("layerbus_decode_trip_tokens_total", "counter", "Tokens the decode trips yielded (one each, plus "
               "the drafts accepted).", (Sample((), counts.decode_tokens),)),
    ]


def job_families(statuses: Sequence[JobStatus]) -> list[Family]:
    """Per job the broker runs or ran (label `job_id`), as the store counts it: items by state, tokens,
    throughput and ETA (the figures `layerbus status` shows)."""
    items, state, generated, prompt, rate, eta = [], [], [], [], [], []
    for status in statuses:
        job = (("job_id", status.job_id),)
        items.extend(Sample(job + (("state", name),), status.counts.get(name, 0)) for name in ITEM_STATES)
        state.extend(Sample(job + (("state", name),), float(status.status == name)) for name in JOB_STATES)
        generated.append(Sample(job, status.completion_tokens))
        prompt.append(Sample(job, status.prompt_tokens))
        if status.tokens_per_s is not None:
            rate.append(Sample(job, status.tokens_per_s))
        if status.eta_s is not None:
            eta.append(Sample(job, status.eta_s))
    return [
        Family("layerbus_job_items", "gauge", "The job's items per state.", tuple(items)),
        Family("layerbus_job_state", "gauge", "The job's state (1 for the state it is in, 0 for the others).",
               tuple(state)),
        Family("layerbus_generated_tokens_total", "counter", "Tokens generated over the job's finished items.",
               tuple(generated)),
        Family("layerbus_prompt_tokens_total", "counter", "Prompt tokens over the job's finished items.",
               tuple(prompt)),
        Family("layerbus_job_tokens_per_second", "gauge", "Generated tokens per second since the job began running.",
               tuple(rate)),
        Family("layerbus_job_eta_seconds", "gauge", "Seconds left for the queued and running items, at the pace "
               "items have finished so far.", tuple(eta)),
    ]


def _placed_labels(stage: StageInfo, placement: Placement | None) -> Labels:
    """Where the stage sits in the chain: its position, layers and outgoing link's codec ("" for a spare;
    the last stage sends tokens)."""
    if placement is None or stage.name not in placement.stages:
        return (("position", ""), ("layers", ""), ("wire", ""))
    i = placement.stages.index(stage.name)
    wire = placement.codecs[i] if i < len(placement.codecs) else ("tokens" if i == len(placement.stages) - 1
                                                                  else "float32")
    return (("position", str(i)), ("layers", str(placement.spans[i])), ("wire", wire))


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: object) -> float:
    """A figure a stage reported, or 0 for anything that is not a finite non-negative number."""
    return float(value) if _finite(value) and value >= 0 else 0.0
