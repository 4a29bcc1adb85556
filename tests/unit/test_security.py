"""The refusals of binds other machines can reach, without keys, and secret keys that never show in a repr.
tests/cluster/test_security.py secures a cluster of real processes with CurveZMQ."""

from __future__ import annotations

import pytest

from layerbus.cli.main import main as layerbus_main
from layerbus.wire.curve import ClusterKeys, is_loopback, make_keypair, read_keypair


@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.1:*", True), ("tcp://127.8.0.1:1", True),
    ("tcp://localhost:5555", True), ("tcp://[::1]:5555", True), ("ipc:///tmp/layerbus.sock", True),
    ("inproc://x", True), ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.0.0.5:5555", False),
    ("tcp://gpu-box-1:5555", False), ("tcp://eth0:5555", False), ("tcp://[::]:5555", False), ("udp://1.2.3.4:5", False),
])
def test_which_binds_other_machines_can_reach(endpoint, loopback):
    assert is_loopback(endpoint) is loopback


def test_a_secret_key_never_shows_in_a_repr_and_the_broker_admits_its_own_key(tmp_path):
    _, secret = make_keypair(tmp_path, "broker")
    keypair = read_keypair(secret)
    assert keypair.secret.decode() not in repr(ClusterKeys(keypair)) and keypair.public.decode() in repr(keypair)
    assert ClusterKeys(keypair).allowed == {keypair.public}, "local stages share the broker's keypair"


@pytest.mark.parametrize("argv, needs", [
    (["broker", "--stages", "1", "--bind-control", "tcp://0.0.0.0:5555"], "--keys DIR"),
    (["broker", "--stages", "1", "--bind-results", "tcp://10.1.2.3:5556"], "--keys DIR"),
    (["stage", "--broker", "tcp://10.1.2.3:5555", "--bind", "tcp://0.0.0.0:6000"], "--keys DIR --broker-key FILE"),
])
def test_a_bind_other_machines_can_reach_is_refused_without_keys(argv, needs, capsys):
    assert layerbus_main(argv) == 2
    error = capsys.readouterr().err
    assert "refusing to bind" in error and "layerbus keys new" in error and needs in error and "--insecure" in error


def test_broker_key_options_that_cannot_work_are_usage_errors(tmp_path, capsys):
    assert layerbus_main(["broker", "--stages", "1", "--allow", str(tmp_path)]) == 2
    assert "--allow needs --keys" in capsys.readouterr().err
    assert layerbus_main(["broker", "--stages", "1", "--keys", str(tmp_path / "none")]) == 2
    assert "layerbus keys new" in capsys.readouterr().err
