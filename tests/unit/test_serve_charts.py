"""The dashboard's SVG pictures (serve/svg_charts.py) and token samples (serve/token_samples.py): what each draws
from its data, every value escaped."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from layerbus.serve.svg_charts import RunPoint, chain_picture, interval_chart, rate_chart
from layerbus.serve.token_samples import TokenSamples
from layerbus.storage.snapshot_records import StageSnapshot


def stage(name: str, position: int | None, start: int | None, end: int | None, **extra) -> StageSnapshot:
    return StageSnapshot(stage=name, position=position, host="box<1>", device="cpu", layer_start=start,
                         layer_end=end, weights="fp32", wire="int8" if position == 0 else None, state="ready", **extra)


def test_the_chain_shows_stages_in_order_with_their_figures():
    svg = chain_picture([stage("b", 1, 15, 30, busy_ratio=0.5), stage("spare", None, None, None),
                         stage("a", 0, 0, 15, busy_ratio=0.97, rss_bytes=300 << 20, memory_budget_bytes=1 << 30,
                               out_bytes_per_s=2.5e6)])

    ET.fromstring(svg)  # well-formed, the host's "<1>" escaped
    assert re.findall(r'data-stage="([^"]+)"', svg) == ["a", "b", "spare"]
    assert "layers [0, 15)" in svg and "busy 97%" in svg and "memory 300 MiB / 1024 MiB" in svg
    assert svg.count('class="link"') == 1 and "2.5 MB/s" in svg and "int8" in svg
    assert "box&lt;1&gt;" in svg


def test_the_history_marks_intervals_and_fingerprint_changes():
    points = [RunPoint(f"day {i}", 0.6 + i / 100, 0.05 if i != 1 else None, f"/c?i={i}&x=1", i == 2, f"run {i}")
              for i in range(3)]

    svg = interval_chart(points, "mc acc")

    ET.fromstring(svg)
    assert svg.count('class="point"') == 3 and svg.count('class="interval"') == 2, "no bar without a stderr"
    assert svg.count('class="fingerprint-change"') == 1 and "/c?i=2&amp;x=1" in svg


def test_rates_between_samples():
    samples = TokenSamples()
    for at, tokens in ((100.0, 0), (101.0, 50), (103.0, 150)):
        samples.record("job_1", at, tokens)

    assert samples.rates("job_1") == [(1.0, 50.0), (3.0, 50.0)]
    assert samples.rates("job_2") == []
    assert "not enough samples" in rate_chart([]) and "<polyline" in rate_chart(samples.rates("job_1"))
