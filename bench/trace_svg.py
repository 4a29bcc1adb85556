"""Render a layerbus trace (`layerbus run --trace FILE`, Trace Event Format JSON) as an SVG timeline:
one lane per process (the broker, then each stage in chain order), spans colored by kind, each lane
labelled with its busy share over the window. Standard library only, so it runs anywhere the JSON is.

    python bench/trace_svg.py trace.json timeline.svg                  # the whole run
    python bench/trace_svg.py trace.json timeline.svg --from 2000 --to 2300   # a 300 ms window (ms from the start)

A whole run holds thousands of steps, far more than a picture can show: pick a window of a few dozen
steps to see the micro-batches move down the chain and the bubbles between them. Each span carries a
<title> (its name, duration and arguments), shown when hovering in a browser.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

# Span category -> fill color. Idle is drawn faintly: the white-ish gaps in a stage's lane are its bubbles.
COLORS = {
    "receive": "#f28e2b",  # stage: wire decode and validation
    "compute": "#4e79a7",  # stage: the layers (last stage: the head and token choice too)
    "send": "#59a14f",  # stage: encode and send
    "idle": "#eeeeee",  # stage: waiting for the next step
    "plan": "#b07aa1",  # broker: scheduling a micro-batch's next step
    "transmit": "#76b7b2",  # broker: encoding and sending it to the first stage
    "result": "#edc948",  # broker: reading a result
    "apply": "#ff9da7",  # broker: applying it (tokens to sequences, finished items delivered)
    "place": "#bab0ac",  # broker: the stages loading their spans
}
LEGEND = [("compute", "compute"), ("receive", "receive (decode, validate)"), ("send", "encode + send"),
          ("idle", "idle (bubble)"), ("plan", "broker: plan step"), ("transmit", "broker: transmit"),
          ("result", "broker: read result"), ("apply", "broker: apply result")]
BUSY = ("receive", "compute", "send")
OTHER_COLOR = "#999999"

LABEL_W, LANE_H, LANE_GAP, TOP, AXIS_H, LEGEND_H = 190, 34, 10, 46, 28, 44


@dataclass
class Lane:
    pid: int
    tid: int
    name: str
    sort: int
    spans: list[dict] = field(default_factory=list)


def read_lanes(document: dict) -> list[Lane]:
    """One lane per (pid, tid) that holds complete events, ordered by the processes' sort index."""
    names: dict[int, str] = {}
    sort: dict[int, int] = {}
    lanes: dict[tuple[int, int], Lane] = {}
    for event in document.get("traceEvents", []):
        if event.get("ph") == "M" and event.get("name") == "process_name":
            names[event["pid"]] = str(event.get("args", {}).get("name", event["pid"]))
        elif event.get("ph") == "M" and event.get("name") == "process_sort_index":
            sort[event["pid"]] = int(event.get("args", {}).get("sort_index", 0))
    for event in document.get("traceEvents", []):
        if event.get("ph") == "X":
            key = (event["pid"], event.get("tid", 0))
            if key not in lanes:
                lanes[key] = Lane(key[0], key[1], "", 0)
            lanes[key].spans.append(event)
    for lane in lanes.values():
        lane.name, lane.sort = names.get(lane.pid, f"pid {lane.pid}"), sort.get(lane.pid, lane.pid)
    return sorted(lanes.values(), key=lambda lane: (lane.sort, lane.pid, lane.tid))


def nice_step(span_us: float, target_ticks: int = 8) -> float:
    raw = span_us / max(1, target_ticks)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def render(document: dict, start_ms: float | None = None, end_ms: float | None = None, width: int = 1200,
           title: str | None = None) -> str:
    lanes = read_lanes(document)
    spans = [span for lane in lanes for span in lane.spans]
    if not spans:
        raise ValueError("the trace holds no complete (ph X) events")
    t0 = start_ms * 1000 if start_ms is not None else min(span["ts"] for span in spans)
    t1 = end_ms * 1000 if end_ms is not None else max(span["ts"] + span["dur"] for span in spans)
    if t1 <= t0:
        raise ValueError(f"empty window: from {t0 / 1000} ms to {t1 / 1000} ms")
    plot_w = width - LABEL_W - 20
    scale = plot_w / (t1 - t0)
    height = TOP + len(lanes) * (LANE_H + LANE_GAP) + AXIS_H + LEGEND_H

    def x(ts: float) -> float:
        return LABEL_W + (min(max(ts, t0), t1) - t0) * scale

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    heading = title or "layerbus trace"
    out.append(f'<text x="10" y="20" font-size="15" font-weight="bold">{escape(heading)}</text>')
    out.append(f'<text x="10" y="37" fill="#555">{(t1 - t0) / 1000:.1f} ms from {t0 / 1000:.1f} ms; '
               f'busy = receive + compute + encode/send share of the window</text>')
    for index, lane in enumerate(lanes):
        y = TOP + index * (LANE_H + LANE_GAP)
        busy = sum(max(0.0, min(s["ts"] + s["dur"], t1) - max(s["ts"], t0)) for s in lane.spans
                   if s.get("cat") in BUSY)
        label = lane.name if len(lane.name) <= 30 else lane.name[:29] + "…"
        out.append(f'<text x="10" y="{y + 14}" font-weight="bold">{escape(label)}</text>')
        if any(s.get("cat") in BUSY for s in lane.spans):
            out.append(f'<text x="10" y="{y + 29}" fill="#555">busy {100 * busy / (t1 - t0):.0f}%</text>')
        out.append(f'<rect x="{LABEL_W}" y="{y}" width="{plot_w}" height="{LANE_H}" fill="#fafafa" stroke="#ddd"/>')
        for span in lane.spans:
            end = span["ts"] + span["dur"]
            if end < t0 or span["ts"] > t1:
                continue
            left, right = x(span["ts"]), x(end)
            color = COLORS.get(span.get("cat", ""), OTHER_COLOR)
            args = ", ".join(f"{k}={v}" for k, v in span.get("args", {}).items())
            tip = escape(f"{span['name']} {span['dur'] / 1000:.3f} ms {args}")
            out.append(f'<rect x="{left:.2f}" y="{y + 2}" width="{max(right - left, 0.4):.2f}" height="{LANE_H - 4}" '
                       f'fill="{color}"><title>{tip}</title></rect>')
            mb = span.get("args", {}).get("mb")
            if span.get("cat") == "compute" and mb is not None and right - left >= 24:
                out.append(f'<text x="{(left + right) / 2:.1f}" y="{y + LANE_H / 2 + 4}" fill="white" '
                           f'text-anchor="middle" font-size="10">mb {mb}</text>')
    axis_y = TOP + len(lanes) * (LANE_H + LANE_GAP)
    out.append(f'<line x1="{LABEL_W}" y1="{axis_y}" x2="{LABEL_W + plot_w}" y2="{axis_y}" stroke="#333"/>')
    step = nice_step(t1 - t0)
    tick = math.ceil(t0 / step) * step
    while tick <= t1:
        tx = x(tick)
        out.append(f'<line x1="{tx:.1f}" y1="{axis_y}" x2="{tx:.1f}" y2="{axis_y + 5}" stroke="#333"/>')
        out.append(f'<text x="{tx:.1f}" y="{axis_y + 18}" text-anchor="middle" fill="#333">{tick / 1000:g} ms</text>')
        tick += step
    legend_y = axis_y + AXIS_H + 8
    lx = 10
    for cat, text in LEGEND:
        out.append(f'<rect x="{lx}" y="{legend_y}" width="12" height="12" fill="{COLORS[cat]}" stroke="#bbb"/>')
        out.append(f'<text x="{lx + 16}" y="{legend_y + 10}">{escape(text)}</text>')
        lx += 16 + 7 * len(text) + 18
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a trace JSON (layerbus run --trace FILE)")
    parser.add_argument("out", type=Path, help="the SVG to write")
    parser.add_argument("--from", dest="start_ms", type=float, default=None, help="window start, ms from the trace's start")
    parser.add_argument("--to", dest="end_ms", type=float, default=None, help="window end, ms from the trace's start")
    parser.add_argument("--width", type=int, default=1200, help="pixels (default: 1200)")
    parser.add_argument("--title", default=None, help="heading (default: layerbus trace)")
    args = parser.parse_args(argv)
    try:
        svg = render(json.loads(args.trace.read_text()), args.start_ms, args.end_ms, args.width, args.title)
    except (ValueError, KeyError) as error:
        print(f"trace_svg: {error}", file=sys.stderr)
        return 2
    args.out.write_text(svg)
    print(f"trace_svg: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
