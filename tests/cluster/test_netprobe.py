"""`layerbus netprobe` end to end: `netprobe serve` and the prober as separate processes, on loopback and
across network namespaces joined by a tbf-limited veth link, where the measured bandwidth must come within
10% of the limit (the one figure asserted: the limit is set, not measured, and the test checks that the
probe finds it). The namespace test skips where namespaces cannot be made (not root, no `ip`/`tc`)."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.netns import StageNamespaces, unavailable_reason
from layerbus.wire import codecs
from tests.helpers.cli import REPO, cli_env, layerbus, layerbus_executable

NAMESPACE_REASON = unavailable_reason()


def config_only_model(path: Path, hidden: int) -> Path:
    """netprobe reads nothing but the hidden size from config.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden}))
    return path


@contextmanager
def netprobe_serve(home: Path, bind: str, prefix: tuple[str, ...] = ()):
    """A `layerbus netprobe serve` process; yields the address it answers on (its first line)."""
    server = subprocess.Popen([*prefix, layerbus_executable(), "netprobe", "serve", "--bind", bind],
                              env=cli_env(home), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip()
        failed = server.stderr.read() if server.poll() is not None else ""
        assert address.startswith("tcp://"), f"serve printed {address!r}: {failed}"
        yield address
    finally:
        server.terminate()
        server.wait(10)
    assert server.returncode == 0, f"serve exit {server.returncode} after SIGTERM: {server.stderr.read()}"


def test_loopback_probe_reports_sane_figures_and_the_codecs_sizes(tmp_path):
    home, model = tmp_path / "home", config_only_model(tmp_path / "model", 96)
    with netprobe_serve(home, "tcp://127.0.0.1:*") as address:
        done = layerbus(home, "netprobe", address, "--model", model, "--micro-batch", "4", "--codec", "fp32", "int4",
                        "--echoes", "20", "--seconds", "0.1", "--step-ms", "5", "--stages", "3", "--json", timeout=60)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        table = layerbus(home, "netprobe", address, "--model", model, "--echoes", "5", "--seconds", "0.05", timeout=60)
    assert (report["target"], report["hidden_size"], report["micro_batch"], report["stages"]) == (address, 96, 4, 3)
    rtt = report["rtt"]
    assert rtt["count"] == 20 and 0 < rtt["min_ms"] <= rtt["median_ms"] <= rtt["p99_ms"]
    assert [link["codec"] for link in report["links"]] == ["float32", "int4"]
    for link in report["links"]:
        assert link["tensor_bytes"] == codecs.wire_bytes(link["codec"], 4, 96), "sizes follow the codecs"
        assert link["step_bytes"] == link["tensor_bytes"] + link["header_bytes"] and link["header_bytes"] > 0
        assert link["bytes_sent"] == link["messages"] * link["step_bytes"] - 1  # the last says true, not false
        assert link["bandwidth_bytes_per_s"] > 0 and link["bandwidth_mbit_s"] > 0
        assert link["link_step_ms"] == pytest.approx(rtt["median_ms"] / 2 + link["transfer_ms"])
        assert link["per_token_ms"] == pytest.approx(link["link_step_ms"] / 4)
        assert link["micro_batches_in_flight"] is None or link["micro_batches_in_flight"] >= 4  # 3 stages + links
    assert table.returncode == 0, table.stderr
    assert "round trip, 5 echoes" in table.stdout and "float32" in table.stdout and "--link-mbps" in table.stdout


LIGHT = """
import contextlib, io, json, sys, threading, zmq
from layerbus.wire import link_probe
context = zmq.Context(); inp = context.socket(zmq.PULL); inp.bind("tcp://127.0.0.1:*")
threading.Thread(target=link_probe.serve, args=(inp, link_probe.EchoPeer(context)), daemon=True).start()
from layerbus.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(["netprobe", "--help"])
    except SystemExit:
        pass
    code = main(["netprobe", inp.last_endpoint.decode(), "--model", sys.argv[1], "--echoes", "3", "--seconds", "0.02"])
print(json.dumps([code, [m for m in ("torch", "transformers") if m in sys.modules]]))
"""


def test_netprobe_never_imports_torch(tmp_path):
    """--help and a whole probe (here against a peer in a thread of the same process) stay light."""
    model = config_only_model(tmp_path / "model", 64)
    result = subprocess.run([sys.executable, "-c", LIGHT, str(model)], capture_output=True, text=True, cwd=REPO,
                            env=cli_env(tmp_path / "home"), timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [0, []]


def test_usage_errors_name_the_way_out(tmp_path):
    home = tmp_path / "home"
    cases = [(["netprobe", "10.0.0.5:7690"], "tcp://HOST:PORT"),
             (["netprobe", "tcp://127.0.0.1:7690", "--bind", "tcp://127.0.0.1:1"], "--bind is for"),
             (["netprobe", "tcp://127.0.0.1:7690", "--codec", "int3"], "fp32, fp16, bf16"),
             (["netprobe", "tcp://127.0.0.1:7690", "--model", tmp_path / "nothing"], "no model directory")]
    for args, named in cases:
        result = layerbus(home, *args)
        assert result.returncode == 2 and named in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_nobody_serving_fails_with_advice(tmp_path):
    home, model = tmp_path / "home", config_only_model(tmp_path / "model", 64)
    result = layerbus(home, "netprobe", "tcp://127.0.0.1:9", "--model", model, "--wait", "0.3")
    assert result.returncode == 1 and "is `layerbus netprobe serve" in result.stderr, result.stderr


@pytest.mark.skipif(NAMESPACE_REASON is not None, reason=f"no network namespaces here: {NAMESPACE_REASON}")
def test_bandwidth_over_a_tbf_limited_link_is_within_10_percent_of_the_limit(tmp_path):
    home, model = tmp_path / "home", config_only_model(tmp_path / "model", 576)
    limit_mbit = 8.0  # a 32 x 576 float32 step (74 kB) crosses it in ~75 ms
    names = ["lb14-np-a", "lb14-np-b"]
    with StageNamespaces(names, rate_mbit=limit_mbit, host_links=False) as net:
        bind = f"tcp://{net.chain_address(1)}:7690"
        with netprobe_serve(home, bind, prefix=tuple(net.command(names[1], []))) as address:
            done = subprocess.run(net.command(names[0], [layerbus_executable(), "netprobe", address, "--model",
                                                         str(model), "--echoes", "20", "--seconds", "2", "--json"]),
                                  env=cli_env(home), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    measured = report["links"][0]["bandwidth_mbit_s"]
    print(f"tbf limit {limit_mbit} Mbit/s, measured {measured:.2f} Mbit/s")
    assert report["reply"].startswith(f"tcp://{net.chain_address(1).rsplit('.', 1)[0]}."), "answers cross the link"
    assert abs(measured - limit_mbit) <= 0.10 * limit_mbit, f"measured {measured:.2f} Mbit/s over a {limit_mbit} limit"
