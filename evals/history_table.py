"""A suite's runs as a table: one line per run (oldest first), one column per (task, metric, filter), each cell
the value with its standard error and the change from the run before. What `layerbus eval history` prints.

Standard library only, so the command stays as light as `layerbus status`.

The change mark is an unpaired glance, not a test: a cell is marked when its change from the previous run is
beyond 1.96 combined standard errors (sqrt(se1^2 + se2^2)). That is conservative, since two runs of one
suite score the same documents and a paired test (`layerbus eval compare`) sees smaller changes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from layerbus.storage.eval_records import EvalMetric, EvalRun

# z for the unpaired 95% band of the change mark.
Z95 = 1.959963984540054
SPARKS = "▁▂▃▄▅▆▇█"
UP, DOWN, SAME = "↑", "↓", "="


@dataclass(frozen=True)
class Column:
    """One (task, metric, filter) of the suite."""

    task: str
    metric: str
    filter: str

    @property
    def label(self) -> str:
        return self.metric if self.filter == "none" else f"{self.metric} ({self.filter})"


@dataclass(frozen=True)
class Cell:
    """One metric of one run."""

    value: float
    stderr: float | None
    n: int
    # UP, DOWN or SAME against the previous run that has this metric; "" for the first one, or a NaN on either side.
    change: str
    # The change is beyond the unpaired 95% band (see the module docstring).
    beyond_noise: bool


@dataclass(frozen=True)
class HistoryLine:
    """One run and its cells, one per column (None where the run lacks that metric)."""

    run: EvalRun
    cells: tuple[Cell | None, ...]
    # The fingerprint differs from the previous run's: another model, tokenizer or settings.
    fingerprint_changed: bool


@dataclass(frozen=True)
class History:
    columns: tuple[Column, ...]
    lines: tuple[HistoryLine, ...]

    def trend(self, column: int) -> str:
        """A sparkline of the column's values across the runs (a space where a run lacks it)."""
        values = [line.cells[column].value if line.cells[column] is not None else math.nan for line in self.lines]
        return sparkline(values)


def history_table(history: Sequence[tuple[EvalRun, Sequence[EvalMetric]]]) -> History:
    """The table of runs given oldest first (as JobStore.eval_history returns them)."""
    columns = _columns(history)
    previous: dict[Column, EvalMetric] = {}
    lines, last_hash = [], None
    for run, metrics in history:
        by_column = {Column(m.task, m.metric, m.filter): m for m in metrics}
        cells = []
        for column in columns:
            metric = by_column.get(column)
            cells.append(None if metric is None else _cell(metric, previous.get(column)))
            if metric is not None:
                previous[column] = metric
        lines.append(HistoryLine(run, tuple(cells), last_hash is not None and run.fingerprint_hash != last_hash))
        last_hash = run.fingerprint_hash
    return History(columns, tuple(lines))


def _columns(history: Sequence[tuple[EvalRun, Sequence[EvalMetric]]]) -> tuple[Column, ...]:
    """Every (task, metric, filter) any run has: tasks in the latest run's suite order, then any others."""
    seen = list(dict.fromkeys(Column(m.task, m.metric, m.filter) for _, metrics in history for m in metrics))
    order = {task: i for i, task in enumerate(_suite_order(history[-1][0]))} if history else {}
    return tuple(sorted(seen, key=lambda c: (order.get(c.task, len(order)), c.task)))


def _suite_order(run: EvalRun) -> list[str]:
    """The task names in the order the run's suite lists them (its settings_json, as eval_run.queue_eval writes it)."""
    try:
        return [task["name"] for task in json.loads(run.settings_json).get("tasks", [])]
    except (ValueError, TypeError, KeyError, AttributeError):  # an older or hand-made run: alphabetical then
        return []


def _cell(metric: EvalMetric, before: EvalMetric | None) -> Cell:
    if before is None or math.isnan(metric.value) or math.isnan(before.value):
        return Cell(metric.value, metric.stderr, metric.n, "", False)
    diff = metric.value - before.value
    change = SAME if diff == 0 else UP if diff > 0 else DOWN
    beyond = (metric.stderr is not None and before.stderr is not None and diff != 0
              and abs(diff) > Z95 * math.hypot(metric.stderr, before.stderr))
    return Cell(metric.value, metric.stderr, metric.n, change, beyond)


def sparkline(values: Sequence[float]) -> str:
    """One block character per value, scaled between the smallest and largest finite ones; NaN is a space."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return " " * len(values)
    low, high = min(finite), max(finite)
    top = len(SPARKS) - 1

    def spark(v: float) -> str:
        if not math.isfinite(v):
            return " "
        return SPARKS[top // 2 if high == low else round((v - low) / (high - low) * top)]

    return "".join(spark(v) for v in values)
