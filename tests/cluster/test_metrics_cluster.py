"""--metrics on real processes: a `layerbus broker` serving a job on 2 `layerbus stage` processes, scraped
during the run by a real Prometheus server (Debian's `prometheus` package: skipped, saying so, where it is
not installed), read back through Prometheus's HTTP API; the endpoint's text passes `promtool check
metrics`; /healthz says 503 before the stages are placed and 200 after; `layerbus run --metrics` serves
while it runs and refuses an address it cannot listen on before queueing anything."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from layerbus.storage import JobStore
from tests.helpers.cli import (JOB_ID, REPO, RUN_TIMEOUT_S, cli_env, documents, layerbus, layerbus_executable,
                               start_run, status_json, wait_for_job, write_jsonl)
from tests.helpers.status_records import get

METRICS_AT = re.compile(r"metrics at (http://127\.0\.0\.1:\d+)/metrics")
WAITING_AT = re.compile(r"waiting for 2 stage\(s\) at (tcp://127\.0\.0\.1:\d+)")
TIMEOUT_S = 120


def wait_for_line(log: Path, pattern: re.Pattern, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = pattern.search(log.read_text())
        if found:
            return found.group(1)
        assert process.poll() is None, f"ended early ({process.returncode}):\n{log.read_text()}"
        time.sleep(0.05)
    raise AssertionError(f"no {pattern.pattern!r} within {TIMEOUT_S} s:\n{log.read_text()}")


def scrape(endpoint: str) -> dict[tuple[str, tuple], float]:
    """(series name, sorted labels) -> value, as the endpoint shows them now."""
    code, text = get(f"{endpoint}/metrics")
    assert code == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for_final_heartbeats(endpoint: str, stages: tuple[str, ...], finished: float) -> None:
    """Until every stage has been heard since `finished` (a monotonic time after its last step): its stats
    in the broker are then its final ones (they travel with heartbeats, every 0.5 s)."""
    deadline = finished + TIMEOUT_S
    while time.monotonic() < deadline:
        asked = time.monotonic()
        ages = {dict(labels)["stage"]: value for (name, labels), value in scrape(endpoint).items()
                if name == "layerbus_stage_heartbeat_age_seconds"}
        if all(stage in ages and ages[stage] < asked - finished for stage in stages):
            return
        time.sleep(0.1)
    raise AssertionError(f"stages {stages} not heard from within {TIMEOUT_S} s after the job ended")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_prometheus(folder: Path, target: str) -> tuple[subprocess.Popen, str] | None:
    """A Prometheus server of its own (config, storage and port), scraping `target` every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    folder.mkdir()
    config = folder / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: layerbus\n    static_configs:\n      - targets: ['{target}']\n")
    address = f"127.0.0.1:{free_port()}"
    with open(folder / "prometheus.log", "w") as log:
        server = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                                   f"--web.listen-address={address}"], stdout=log, stderr=subprocess.STDOUT)
    return server, f"http://{address}"


def query(prometheus: str, expression: str) -> list[dict]:
    code, body = get(f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expression})}")
    assert code == 200, body
    return json.loads(body)["data"]["result"]


def eventually(prometheus: str, expression: str, done) -> list[dict]:
    """The query's result once `done` accepts it (Prometheus has scraped what the test waits for)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        found = query(prometheus, expression)
        if done(found):
            return found
        assert time.monotonic() < deadline, f"Prometheus answers {found} to {expression}"
        time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_models):
    """A broker with --metrics, a Prometheus scraping it (where installed), 2 stages, one job run to its end."""
    tmp = tmp_path_factory.mktemp("metrics")
    tiny, home, db = tiny_models("llama"), tmp / "home", f"sqlite:///{tmp / 'jobs.db'}"
    corpus = write_jsonl(tmp / "corpus.jsonl", documents(12))
    submitted = layerbus(home, "submit", corpus, "--task", "summarize", "--model", tiny, "--db", db,
                         "--max-new-tokens", "10")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    processes = []
    try:
        log = tmp / "broker.log"
        with open(log, "w") as handle:
            broker = subprocess.Popen([layerbus_executable(), "broker", "--stages", "2", "--model", str(tiny),
                                       "--db", db, "--partition", "equal", "--slots", "4", "--poll", "0.2",
                                       "--bind-control", "tcp://127.0.0.1:*", "--bind-results", "tcp://127.0.0.1:*",
                                       "--metrics", "127.0.0.1:0"],
                                      env=cli_env(home), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
        processes.append(broker)
        endpoint = wait_for_line(log, METRICS_AT, broker)
        address = wait_for_line(log, WAITING_AT, broker)
        before = get(f"{endpoint}/healthz")[0]
        prometheus = start_prometheus(tmp / "prometheus", endpoint.removeprefix("http://"))
        if prometheus is not None:
            processes.append(prometheus[0])
        for i in range(2):
            with open(tmp / f"stage-{i}.log", "w") as handle:
                processes.append(subprocess.Popen(
                    [layerbus_executable(), "stage", "--broker", address, "--name", f"stage-{i}", "--threads", "1"],
                    env=cli_env(home), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT))
        with JobStore.open(db) as store:
            deadline = time.monotonic() + TIMEOUT_S
            while store.job_status(job_id).status != "completed":
                assert time.monotonic() < deadline and broker.poll() is None, log.read_text()
                time.sleep(0.1)
            status = store.job_status(job_id)
        wait_for_final_heartbeats(endpoint, ("stage-0", "stage-1"), time.monotonic())
        yield {"endpoint": endpoint, "job": job_id, "status": status, "healthz_before": before,
               "prometheus": prometheus[1] if prometheus else None, "log": log}
    finally:
        for process in reversed(processes):
            stop(process)


def test_the_endpoint_reports_the_job_and_both_stages(served):
    assert served["healthz_before"] == 503, "no stage had registered yet"
    assert get(f"{served['endpoint']}/healthz")[0] == 200
    samples = scrape(served["endpoint"])
    job = (("job_id", served["job"]),)
    assert samples[("layerbus_generated_tokens_total", job)] == served["status"].completion_tokens > 0
    assert samples[("layerbus_prompt_tokens_total", job)] == served["status"].prompt_tokens
    assert samples[("layerbus_job_items", job + (("state", "completed"),))] == 12
    busy = {dict(labels)["stage"]: value for (name, labels), value in samples.items()
            if name == "layerbus_stage_busy_ratio"}
    assert set(busy) == {"stage-0", "stage-1"} and all(0 <= value <= 1 for value in busy.values())
    for stage in ("stage-0", "stage-1"):
        assert samples[("layerbus_stage_busy_seconds_total", (("stage", stage),))] > 0
        steps = samples[("layerbus_stage_step_seconds_count", (("stage", stage),))]
        assert steps > 0 and samples[("layerbus_stage_step_seconds_bucket", (("le", "+Inf"), ("stage", stage)))] == steps
        assert samples[("layerbus_stage_memory_used_bytes", (("memory", "host"), ("stage", stage)))] > 0
    sent = samples[("layerbus_stage_sent_bytes_total", (("stage", "stage-0"),))]
    assert sent > 0 and samples[("layerbus_stage_received_bytes_total", (("stage", "stage-1"),))] == sent, \
        "what stage 0 sent is what stage 1 received"


def test_promtool_passes_the_endpoints_text(served):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: `apt-get install prometheus` (Debian) brings it")
    text = get(f"{served['endpoint']}/metrics")[1]
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_real_prometheus_reads_the_jobs_tokens_and_every_stages_busy_ratio(served):
    prometheus = served["prometheus"]
    if prometheus is None:
        pytest.skip("no Prometheus server: `apt-get install prometheus` (Debian's package) to run this test")
    expected = served["status"].completion_tokens
    generated = f'layerbus_generated_tokens_total{{job_id="{served["job"]}"}}'
    # It scrapes every second: a scrape after the job's end (and after the stages' final heartbeats, which the
    # fixture waited for) brings the final figures.
    found = eventually(prometheus, generated, lambda found: found and float(found[0]["value"][1]) == expected)
    assert found[0]["metric"]["job"] == "layerbus", "Prometheus's own job label, beside our job_id"
    worked = eventually(prometheus, "max_over_time(layerbus_stage_busy_ratio[10m]) > 0",
                        lambda found: len(found) == 2)
    assert sorted(series["metric"]["stage"] for series in worked) == ["stage-0", "stage-1"]
    busy = query(prometheus, "layerbus_stage_busy_ratio")
    assert sorted(series["metric"]["stage"] for series in busy) == ["stage-0", "stage-1"]


def test_run_serves_metrics_while_it_runs(tmp_path, tiny_models):
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(200))  # far more than runs before the stop
    log = tmp_path / "run.log"
    run = start_run(home, log, corpus, "--task", "summarize", "--model", tiny_models("llama"), "--stages", "2",
                    "--db", db, "--max-new-tokens", "64", "--slots", "2", "--threads-per-stage", "1",
                    "--partition", "equal", "--metrics", "127.0.0.1:0")
    try:
        endpoint = wait_for_line(log, METRICS_AT, run)
        job_id = wait_for_job(db, lambda status: status.completed >= 1, "a completed item", run, log)
        assert get(f"{endpoint}/healthz")[0] == 200
        text = get(f"{endpoint}/metrics")[1]
        assert f'layerbus_job_items{{job_id="{job_id}",state="completed"}}' in text
        assert 'stage="stage-0"' in text and 'stage="stage-1"' in text
        run.send_signal(signal.SIGINT)
        assert run.wait(RUN_TIMEOUT_S) == 130, log.read_text()
    finally:
        run.kill()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{endpoint}/healthz", timeout=5)  # closed with the run


def test_an_address_that_cannot_be_listened_on_is_a_usage_error_before_anything_is_queued(tmp_path, tiny_models):
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents(2))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = layerbus(home, "run", corpus, "--task", "summarize", "--model", tiny_models("llama"),
                          "--stages", "2", "--db", db, "--metrics", f"127.0.0.1:{port}")
    assert result.returncode == 2, result.stderr
    assert f"cannot serve metrics at http://127.0.0.1:{port}" in result.stderr and "another port" in result.stderr
    assert "Traceback" not in result.stderr
    assert status_json(home, "--db", db) == [], "nothing was queued"
    bad = layerbus(home, "broker", "--stages", "2", "--model", tiny_models("llama"), "--db", db,
                   "--metrics", "127.0.0.1:99999")
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
    assert JOB_ID.search(result.stdout) is None
