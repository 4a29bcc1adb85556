"""One frame of `layerbus top`: a job's progress and ETA, then a table of its stages as their broker last
wrote them (storage/snapshot_records.py). Pure: the rows, the clock and the width come in, text goes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from itertools import groupby

from layerbus.cli.status import duration_text
from layerbus.storage.status_records import JobStatus
from layerbus.storage.snapshot_records import StageSnapshot

# A broker's snapshot older than this is shown as stale: its broker stopped writing (killed, cut off, done).
DEFAULT_STALE_AFTER_S = 10.0
COLUMNS = ("STAGE", "HOST", "LAYERS", "WEIGHTS", "WIRE", "STATE", "BUSY", "STEP ms", "STEPS", "MEM/BUDGET",
           "OUT MB/s", "IN MB/s", "HEARD")
# Right-aligned columns: the figures.
_NUMERIC = {"BUSY", "STEP ms", "STEPS", "MEM/BUDGET", "OUT MB/s", "IN MB/s", "HEARD"}
_BAR_WIDTH = 20


def top_frame(status: JobStatus, snapshots: Sequence[StageSnapshot], now: datetime,
              stale_after_s: float = DEFAULT_STALE_AFTER_S, width: int | None = None) -> str:
    """The frame for `status` and its stages' `snapshots` (in snapshot_order) at `now`; lines cut to `width`."""
    lines = job_lines(status, now)
    if not snapshots:
        lines += ["", "no stage snapshots: the job's broker writes them every few seconds while it runs"]
    for broker, group in groupby(snapshots, key=lambda s: s.broker):
        rows = list(group)
        age = _age_s(rows, now)
        stale = age is not None and age > stale_after_s
        note = f"snapshot {_seconds(age)} old" if age is not None else "snapshot time unknown"
        if stale:
            note += f": stale (over {stale_after_s:g} s), its broker stopped writing"
        lines += ["", f"broker {broker or '?'}  {note}", *stage_table(rows, stale)]
    return "\n".join(line[:width] if width else line for line in lines)


def job_lines(status: JobStatus, now: datetime) -> list[str]:
    """The frame's head: the job, its state, item progress, tokens and ETA."""
    name = f" ({status.name})" if status.name else ""
    done = status.completed + status.failed + status.cancelled
    rate = f", {status.tokens_per_s:.1f} tok/s" if status.tokens_per_s is not None else ""
    eta = f"  eta {duration_text(status.eta_s)}" if status.eta_s is not None else ""
    return [
        f"layerbus top  {status.job_id}{name}  {status.status}  {now.strftime('%Y-%m-%d %H:%M:%S')} UTC",
        f"items   {progress_bar(done, status.total)} {done}/{status.total} done: {status.completed} completed, "
        f"{status.failed} failed, {status.cancelled} cancelled, {status.in_progress} in progress, "
        f"{status.queued} queued",
        f"tokens  {status.completion_tokens:,} generated, {status.prompt_tokens:,} prompt{rate}{eta}",
    ]


def progress_bar(done: int, total: int, width: int = _BAR_WIDTH) -> str:
    """`[#####...............]  25%`: the share of items finished."""
    share = done / total if total else 0.0
    filled = min(width, int(share * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {share * 100:3.0f}%"


def stage_table(snapshots: Sequence[StageSnapshot], stale: bool = False) -> list[str]:
    """The header and one aligned line per stage; a stale broker's stages show the state `stale`."""
    rows = [stage_cells(s, stale) for s in snapshots]
    widths = [max(len(row[i]) for row in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    return ["  ".join(cell.rjust(w) if name in _NUMERIC else cell.ljust(w)
                      for name, cell, w in zip(COLUMNS, row, widths)).rstrip() for row in [COLUMNS, *rows]]


def stage_cells(s: StageSnapshot, stale: bool = False) -> tuple[str, ...]:
    """One stage's cells, in COLUMNS order; "-" for what the stage did not report."""
    layers = f"[{s.layer_start}, {s.layer_end})" if s.layer_start is not None and s.layer_end is not None else "-"
    memory = s.rss_bytes if s.rss_bytes is not None else s.peak_rss_bytes  # the peak where only that is reported
    return (
        s.stage, s.host, layers, s.weights or "-", s.wire or "-", "stale" if stale else s.state,
        f"{s.busy_ratio * 100:.0f}%" if s.busy_ratio is not None else "-",
        f"{s.step_s * 1e3:.1f}" if s.step_s is not None else "-",
        str(s.steps) if s.steps is not None else "-",
        f"{_bytes(memory)}/{_bytes(s.memory_budget_bytes)}" if memory or s.memory_budget_bytes else "-",
        _mb_per_s(s.out_bytes_per_s), _mb_per_s(s.in_bytes_per_s),
        _seconds(s.heartbeat_age_s) if s.heartbeat_age_s is not None else "-",
    )


def _age_s(rows: Sequence[StageSnapshot], now: datetime) -> float | None:
    stamps = [s.updated_at for s in rows if s.updated_at is not None]
    return max(0.0, (now - max(stamps)).total_seconds()) if stamps else None


def _bytes(value: int | None) -> str:
    """Binary units, 3 significant figures at most: 512, 9.5K, 412M, 1.5G."""
    if value is None:
        return "-"
    size, unit = float(value), ""
    for unit in ("", "K", "M", "G", "T"):
        if size < 1024 or unit == "T":
            break
        size /= 1024
    return f"{size:.1f}{unit}" if unit and size < 10 else f"{size:.0f}{unit}"


def _mb_per_s(value: float | None) -> str:
    if value is None:
        return "-"
    mb = value / 1e6
    return f"{mb:.2f}" if mb < 10 else f"{mb:.1f}" if mb < 100 else f"{mb:.0f}"


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 60 else duration_text(value)

