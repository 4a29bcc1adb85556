"""deploy/: the Grafana dashboard queries only metrics the broker serves, in PromQL that Prometheus's own
parser accepts (`promtool check rules` on the dashboard's expressions), and the scrape example is a valid
Prometheus config (`promtool check config`); the promtool checks are skipped, saying so, without it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from layerbus.planner.chain import Placement
from layerbus.broker.metrics import counter_families, job_families, stage_families
from layerbus.broker.run_state import BrokerCounts
from layerbus.wire.spans import LayerRange
from tests.helpers.cli import REPO
from tests.helpers.status_records import job_status, stage

DASHBOARD = REPO / "deploy" / "grafana" / "layerbus.json"
SCRAPE_EXAMPLE = REPO / "deploy" / "prometheus" / "prometheus.yml"
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    found += [variable["query"] for variable in dashboard["templating"]["list"]]
    return found


def served_names() -> set[str]:
    """Every series name a scrape can show (histograms as their _bucket, _count and _sum series)."""
    stats = {"step_le": [0.1], "step_counts": [1, 0], "uptime_s": 1.0}
    families = (stage_families([stage("a", stats=stats, memory_budget=1)],
                               Placement(("a",), (LayerRange(0, 2),)), 0.0, {"a": 0.5})
                + counter_families(BrokerCounts(), True, 1) + job_families([job_status()]))
    names = set()
    for family in families:
        if family.kind == "histogram":
            names.update(family.name + suffix for suffix in HISTOGRAM_SERIES)
        else:
            names.add(family.name)
    return names


def test_the_dashboard_queries_only_served_metrics():
    queried = {name for expression in expressions() for name in re.findall(r"\blayerbus_[a-z_]+", expression)}
    assert queried and not queried - served_names(), f"not served: {sorted(queried - served_names())}"
    assert any("histogram_quantile(0.99" in e and "layerbus_stage_step_seconds_bucket" in e for e in expressions())


def test_the_dashboards_promql_parses(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: `apt-get install prometheus` (Debian) brings it")
    queries = [e for e in expressions() if not e.startswith("label_values(")]  # Grafana's, not PromQL
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": query.replace("$job", ".*").replace("$stage", ".*")}
        for i, query in enumerate(queries)]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_scrape_example_is_a_valid_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: `apt-get install prometheus` (Debian) brings it")
    checked = subprocess.run([promtool, "check", "config", "--syntax-only", str(SCRAPE_EXAMPLE)],
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
