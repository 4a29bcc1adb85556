"""CurveZMQ on every link of a cluster, with real sockets and real processes: local clusters are
secured with throwaway keys by default; stages with a wrong key or none never register and are recorded
in the run's events; a forged step pushed to a stage's data port from outside is refused in the handshake
and never reaches the stage; outputs equal an unsecured run's. tests/unit/test_security.py holds the
refusals of binds other machines can reach, without keys."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import zmq

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.requests import GenerationRequest
from layerbus.broker.run_state import ListSource
from layerbus.planner.batching import BatchingConfig
from layerbus.wire import protocol
from layerbus.wire.curve import make_keypair, read_keypair, secure_client
from layerbus.wire.frames import encode
from layerbus.wire.protocol import StepRow

REPO = Path(__file__).resolve().parents[2]


# -- a secured cluster, and the peers it refuses ----------------------------------------------------
def forged_step(epoch: int) -> list:
    """A well-formed step for the first stage: applied, it would overwrite slot 0's cache and send a result."""
    header = {"kind": protocol.STEP, "mb": 0, "step": 10_000, "attempt": 0, "epoch": epoch,
              "rows": protocol.rows_to_json([StepRow(0, 0, 3, True)]), "release": []}
    return encode(header, {"tokens": torch.tensor([7, 8, 9], dtype=torch.int64)})


def push_from_outside(context: zmq.Context, address: str, keys=None) -> zmq.Socket:
    """A PUSH socket that sends a forged step to `address`: with no key, or with (keypair, server key)."""
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(push, *keys)
    push.connect(address)
    return push


def start_rogue_stage(name: str, broker: str, log: Path, *key_args: str) -> subprocess.Popen:
    with open(log, "wb") as handle:
        return subprocess.Popen([sys.executable, "-m", "layerbus.stages", "--broker", broker, "--name", name,
                                 "--threads", "1", *key_args], stdout=subprocess.DEVNULL, stderr=handle,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))


def run_requests(cluster: LocalCluster, requests) -> tuple[dict, list, object]:
    outputs, events = {}, []
    sink = type("Sink", (), {"deliver": lambda self, results: outputs.update((r.request_id, r) for r in results)})()
    stats = cluster.broker.run(ListSource(requests), sink,
                               events=lambda kind, message, **_: events.append((kind, message)))
    return {rid: result.token_ids for rid, result in outputs.items()}, events, stats


def test_secured_cluster_refuses_strangers_records_them_and_computes_what_an_unsecured_one_does(tiny_models,
                                                                                               tmp_path):
    model_dir = tiny_models("llama", num_hidden_layers=4)
    requests = [GenerationRequest(f"r{i}", [5 + i, 17, 33, 2 + i], max_new_tokens=10) for i in range(6)]
    config = BrokerConfig(str(model_dir), 2, partition="equal",
                          batching=BatchingConfig(num_slots=4, num_micro_batches=2, max_step_tokens=16))
    stranger = read_keypair(make_keypair(tmp_path / "stranger", "stranger")[1])
    cluster = LocalCluster(config, LocalStageOptions(threads_per_stage=1, log_dir=tmp_path / "logs"))
    context, sockets, rogues = zmq.Context(), [], []
    try:
        broker = cluster.spawn()
        keys = cluster.config.keys
        assert keys is not None and cluster.key_dir is not None, "a local cluster is secured by default"
        broker_public = tmp_path / "broker.key"  # a copy: the throwaway folder is gone once the stages loaded
        broker_public.write_bytes(Path(str(keys.keypair.path).removesuffix("_secret")).read_bytes())
        rogues = [start_rogue_stage("rogue-no-key", broker.address, tmp_path / "no-key.log"),
                  start_rogue_stage("rogue-wrong-key", broker.address, tmp_path / "wrong-key.log",
                                    "--keys", str(stranger.path), "--broker-key", str(broker_public))]
        cluster.start()
        assert cluster.key_dir is None, "the throwaway keys are deleted once the stages hold them"
        first = broker.chain[0]
        # From outside: no key, then a key the first stage does not admit (knowing its public key).
        sockets = [push_from_outside(context, first.data_address),
                   push_from_outside(context, first.data_address, (stranger, first.public_key.encode()))]
        for socket in sockets:
            socket.send_multipart(forged_step(broker.control.epoch))
        # A peer with no key has no address in libzmq's report; one with a refused key is named with it.
        unnamed = "refused a connection (libzmq does not say from where): "
        named = f"refused a connection from 127.0.0.1 with key {stranger.public.decode()}: its key is not allowed"
        expected = [f"{side} {refusal}" for side in ("the broker", f"stage {first.name}'s data port")
                    for refusal in (unnamed, named)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(any(m.startswith(e) for m in broker.control.refusals)
                                                       for e in expected):
            broker.keep_alive(0.2)
        outputs, events, stats = run_requests(cluster, requests)
        # The stage's counters reach the broker with its heartbeats, which may lag the job's end.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and first.stats.get("refused", 0) < 2:
            broker.keep_alive(0.2)
        first_stats = dict(first.stats)
    finally:
        for socket in sockets:
            socket.close(linger=0)
        context.term()
        cluster.close()
        for rogue in rogues:
            try:
                rogue.wait(30)
            except subprocess.TimeoutExpired:
                rogue.kill()
                rogue.wait()
    refused = [message for kind, message in events if kind == "refused"]
    for message in expected:
        assert any(m.startswith(message) for m in refused), f"not recorded: {message!r}; recorded: {refused}"
    assert {stage.name for stage in broker.control.stages.values()} == {"stage-0", "stage-1"}, "no rogue registered"
    for rogue, log in zip(rogues, ("no-key.log", "wrong-key.log")):
        text = (tmp_path / log).read_text()
        assert rogue.returncode == 2 and "no link to the broker" in text, f"{log}: exit {rogue.returncode}\n{text}"
    assert "the server refused this side's key" in (tmp_path / "wrong-key.log").read_text()
    # The forged steps never reached the stage (not even to be rejected) and nothing of them came back.
    assert first_stats["rejected"] == 0 and first_stats["refused"] >= 2 and stats.discarded == 0
    assert all(protocol.STEP not in message for message in refused)

    with LocalCluster(config, LocalStageOptions(threads_per_stage=1, secure=False)) as unsecured:
        assert unsecured.config.keys is None and all(stage.public_key is None for stage in unsecured.broker.chain)
        plain_outputs, _, _ = run_requests(unsecured, requests)
    assert outputs == plain_outputs and len(outputs) == len(requests)
