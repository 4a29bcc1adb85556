"""The dashboard's pictures, drawn as SVG on the server: a line of tokens/s over time, a metric over eval runs with
95% intervals and fingerprint changes marked, and a running job's chain of stages. Pure functions of their data,
so the page needs no charting library and no script to show them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from layerbus.storage.snapshot_records import StageSnapshot

WIDTH, HEIGHT, PAD = 640, 220, 40
Z95 = 1.959964  # a normal 95% interval is value +- Z95 standard errors
BOLD = ' font-weight="bold"'


@dataclass(frozen=True)
class RunPoint:
    """One eval run's value of one metric."""

    label: str  # what the x axis says under it (the run's date)
    value: float
    stderr: float | None
    href: str  # where a click on the point goes (a compare with the run before)
    new_fingerprint: bool  # what was run changed since the run before (model, weights, settings...)
    title: str  # the tooltip: job id and the value's figures


def _scale(values: Sequence[float], low_px: float, high_px: float) -> tuple[float, float, Callable[[float], float]]:
    low, high = min(values), max(values)
    if high - low < 1e-12:
        low, high = low - 1.0 if low == 0 else low * 0.9, high + 1.0 if high == 0 else high * 1.1
        low, high = min(low, high), max(low, high)
    return low, high, lambda v: low_px + (v - low) / (high - low) * (high_px - low_px)


def _frame(title: str, body: list[str], low: float, high: float, kind: str) -> str:
    axis = [f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - 10}" y2="{HEIGHT - PAD}" stroke="#888"/>',
            f'<line x1="{PAD}" y1="10" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#888"/>',
            f'<text x="4" y="{HEIGHT - PAD}" font-size="10">{low:.3g}</text>',
            f'<text x="4" y="18" font-size="10">{high:.3g}</text>']
    return (f'<svg class="chart {kind}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>'
            + "".join(axis + body) + "</svg>")


def rate_chart(samples: Sequence[tuple[float, float]], title: str = "tokens/s") -> str:
    """(seconds since start, tokens/s) points as a line; a note instead when there are fewer than two."""
    if len(samples) < 2:
        return f'<p class="chart empty">{escape(title)}: not enough samples yet (the server samples running jobs)</p>'
    xs, ys = [t for t, _ in samples], [r for _, r in samples]
    _, _, x_at = _scale(xs, PAD, WIDTH - 10)
    low, high, y_at = _scale([0.0, *ys], HEIGHT - PAD, 10)
    points = " ".join(f"{x_at(t):.1f},{y_at(r):.1f}" for t, r in samples)
    body = [f'<polyline points="{points}" fill="none" stroke="#2a6fdb" stroke-width="2"/>',
            f'<text x="{PAD}" y="{HEIGHT - PAD + 14}" font-size="10">0 s</text>',
            f'<text x="{WIDTH - 60}" y="{HEIGHT - PAD + 14}" font-size="10">{xs[-1] - xs[0]:.0f} s</text>']
    return _frame(title, body, low, high, "rate")


def interval_chart(points: Sequence[RunPoint], title: str) -> str:
    """Each run's value with its 95% interval, in run order; a dashed line before a run whose fingerprint changed."""
    if not points:
        return f'<p class="chart empty">{escape(title)}: no runs</p>'
    bounds = []
    for p in points:
        half = Z95 * (p.stderr or 0.0)
        bounds += [p.value - half, p.value + half]
    low, high, y_at = _scale(bounds, HEIGHT - PAD, 10)
    step = (WIDTH - PAD - 30) / max(1, len(points) - 1) if len(points) > 1 else 0
    body: list[str] = []
    for i, p in enumerate(points):
        x = PAD + 15 + i * step if len(points) > 1 else (WIDTH + PAD) / 2
        half = Z95 * (p.stderr or 0.0)
        if p.new_fingerprint and i > 0:
            body.append(f'<line class="fingerprint-change" x1="{x - step / 2:.1f}" y1="10" x2="{x - step / 2:.1f}" '
                        f'y2="{HEIGHT - PAD}" stroke="#d08000" stroke-dasharray="4 3"><title>what was run changed'
                        '</title></line>')
        if half > 0:
            body.append(f'<line class="interval" x1="{x:.1f}" y1="{y_at(p.value - half):.1f}" x2="{x:.1f}" '
                        f'y2="{y_at(p.value + half):.1f}" stroke="#555"/>')
        body.append(f'<a href="{escape(p.href)}"><circle class="point" cx="{x:.1f}" cy="{y_at(p.value):.1f}" r="5" '
                    f'fill="#2a6fdb"><title>{escape(p.title)}</title></circle></a>')
        body.append(f'<text x="{x - 20:.1f}" y="{HEIGHT - PAD + 14}" font-size="9">{escape(p.label)}</text>')
    return _frame(title, body, low, high, "history")


def chain_picture(stages: Sequence[StageSnapshot]) -> str:
    """The chain's stages in order, each a box with its host, layers, weights, busy %, memory against its budget,
    and the link to the next with its codec and MB/s. Stages holding no span are listed after, dimmed."""
    placed = sorted((s for s in stages if s.position is not None), key=lambda s: s.position or 0)
    spare = [s for s in stages if s.position is None]
    box_w, gap, box_h = 170, 60, 120
    width = max(1, len(placed) + len(spare)) * (box_w + gap)
    parts = []
    for i, stage in enumerate([*placed, *spare]):
        x = 10 + i * (box_w + gap)
        dim = ' opacity="0.45"' if stage.position is None else ""
        layers = f"[{stage.layer_start}, {stage.layer_end})" if stage.layer_start is not None else "no layers"
        busy = f"{stage.busy_ratio * 100:.0f}%" if stage.busy_ratio is not None else "-"
        memory = _memory(stage)
        lines = [stage.stage, f"{stage.host} {stage.device}", f"layers {layers}", f"weights {stage.weights or '-'}",
                 f"busy {busy} · {stage.state}", memory]
        text = "".join(f'<text x="{x + 8}" y="{24 + 17 * k}" font-size="{12 if k == 0 else 11}"{BOLD if k == 0 else ""}>'
                       f'{escape(line)}</text>' for k, line in enumerate(lines))
        parts.append(f'<g class="stage" data-stage="{escape(stage.stage)}"{dim}><rect x="{x}" y="6" width="{box_w}" '
                     f'height="{box_h}" rx="8" fill="#eef3fb" stroke="#2a6fdb"/>{text}</g>')
        if stage.position is not None and i + 1 < len(placed):
            rate = f"{stage.out_bytes_per_s / 1e6:.1f} MB/s" if stage.out_bytes_per_s is not None else "-"
            mid = x + box_w
            parts.append(f'<g class="link"><line x1="{mid}" y1="{6 + box_h / 2}" x2="{mid + gap}" y2="{6 + box_h / 2}" '
                         f'stroke="#555" stroke-width="2"/><text x="{mid + 2}" y="{box_h / 2}" font-size="9">'
                         f'{escape(stage.wire or "-")}</text><text x="{mid + 2}" y="{box_h / 2 + 24}" font-size="9">'
                         f'{escape(rate)}</text></g>')
    return (f'<svg class="chain" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{box_h + 12}" '
            f'role="img" aria-label="the chain of stages">{"".join(parts)}</svg>')


def _memory(stage: StageSnapshot) -> str:
    if stage.rss_bytes is None:
        return "memory -"
    used = f"{stage.rss_bytes / 2**20:.0f} MiB"
    if stage.memory_budget_bytes:
        return f"memory {used} / {stage.memory_budget_bytes / 2**20:.0f} MiB"
    return f"memory {used}"
