"""A run's prediction against what ran: the plan's figures beside the stages' measured busy time, logged
per stage and told to the job's events ("predicted", which `layerbus status JOB` shows)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from layerbus.broker.job_simulation import job_shape
from layerbus.broker.run_state import RecordingSink, RecordingSource, RunStats
from layerbus.planner.placement import estimate_split
from layerbus.planner.plan_report import format_prediction, prediction_report
from layerbus.planner.workload import Workload

if TYPE_CHECKING:
    from layerbus.broker.chain_keeper import ChainKeeper

log = logging.getLogger("layerbus.broker")


def prediction_of_run(keeper: ChainKeeper, workload: Workload | None, before: dict, stats: RunStats,
                      source: RecordingSource, sink: RecordingSink, events=None) -> dict:
    """Log predicted against measured, per stage, one table line each, and tell `events` the same table;
    the report as a dict too (on the summary line's record as `prediction`, for benchmarks)."""
    plan = keeper.plan
    produced = None
    lengths = sink.output_lengths(source.request_ids)
    if lengths is not None and workload is not None and len(lengths) == workload.items:
        # The plan's cost model again, now told where outputs really ended: what is left of the
        # difference is the cost model's, not the guess of the output lengths.
        job = job_shape(workload.with_output_lengths(lengths), keeper.batching)
        inputs = keeper.plan_inputs(keeper.chain)
        produced = estimate_split([p for name in plan.order for p in keeper.profiles if p.name == name],
                                  plan.spans, inputs.memory, keeper.batching, plan.options, job, inputs.network)
    report = prediction_report(plan, before, stats.stage_stats, stats.new_tokens, stats.wall_s, produced,
                               finished=stats.finished, prompt_tokens=stats.prompt_tokens)
    lines = format_prediction(report)
    for line in lines[:-1]:
        log.info("%s", line)
    log.info("%s", lines[-1], extra={"prediction": report})
    if events is not None:
        events("predicted", "\n".join(lines))
    return report
