"""A stage's data plane: pull a step, check it, run it on the span held, push the result to the next hop.

A bad message is rejected and reported (the stage keeps serving), a failed step is reported with its error
text, and a send that cannot go (the next stage gone or stuck) is reported so the broker resends: the
stage never dies of a step. Another stage timing its link to this one sends probes to the same port,
answered here and never taken for steps.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import zmq

from layerbus.stages.emulation import StepTimer
from layerbus.stages.forward import run_step
from layerbus.stages.host import current_rss_bytes, device_memory_bytes, peak_rss_bytes
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.peer_links import is_link_probe
from layerbus.stages.replay import replay_step
from layerbus.stages.sampling import last_stage_outputs
from layerbus.stages.shard import StageShard
from layerbus.stages.step_validation import StepExpectations, validate_step
from layerbus.stages.tracing import StageTracer
from layerbus.wire import codecs, protocol
from layerbus.wire.curve import StageKeys, secure_client
from layerbus.wire.frames import Message, WireError, decode, encode
from layerbus.wire.link_probe import EchoPeer
from layerbus.wire.protocol import StepRow

log = logging.getLogger("layerbus.stage")

# Upper bounds (seconds) of the step-time histogram a stage keeps (the broker serves it as Prometheus's
# layerbus_stage_step_seconds): from a tiny model's millisecond steps to an old card's long prefill.
STEP_SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass
class StageStats:
    busy_s: float = 0.0  # time spent running steps (decode + compute + encode)
    codec_s: float = 0.0  # of which: wire codec decode of incoming and encode of outgoing hidden states
    bytes_out: int = 0  # tensor-frame bytes sent to the next hop (headers not counted)
    bytes_in: int = 0  # tensor-frame bytes received from the hop before (headers not counted)
    steps: int = 0
    tokens: int = 0  # positions processed
    rejected: int = 0
    refused: int = 0  # peers refused in the data port's handshake (their messages never arrive)
    started_at: float = 0.0
    device: str = "cpu"  # where the layers live: a GPU's memory is reported beside the process's
    # Steps per step-time bucket (STEP_SECONDS_BUCKETS, then one for longer steps): counted where busy_s
    # grows, so the histogram's sum is busy_s and its count is steps.
    step_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_SECONDS_BUCKETS) + 1))

    def observe_step(self, seconds: float) -> None:
        self.busy_s += seconds
        self.steps += 1
        self.step_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1

    def to_json(self) -> dict:
        return {"busy_s": round(self.busy_s, 6), "steps": self.steps, "tokens": self.tokens,
                "rejected": self.rejected, "refused": self.refused, "codec_s": round(self.codec_s, 6),
                "bytes_out": self.bytes_out, "bytes_in": self.bytes_in,
                "uptime_s": round(time.monotonic() - self.started_at, 6),
                "peak_rss": peak_rss_bytes(), "rss_bytes": current_rss_bytes(),
                "device_bytes": device_memory_bytes(self.device),
                "step_le": list(STEP_SECONDS_BUCKETS), "step_counts": list(self.step_counts)}


@dataclass
class HeldSpan:
    """What a stage serves now: its layers and their caches, for which epoch, and how it sends on. Replaced
    field by field only by a fully made assignment (StageWorker); `drop` empties it."""

    shard: StageShard | None = None
    arena: KVArena | None = None
    epoch: int = -1
    loaded_as: tuple[str, str] | None = None  # (model directory, weight format) of the loaded span
    wire_codec: str = codecs.DEFAULT_CODEC  # how outgoing hidden states travel (the broker's ASSIGN says)
    tracer: StageTracer | None = None  # step records, only while the broker asks (ASSIGN's trace)

    def drop(self) -> None:
        self.shard, self.arena, self.epoch = None, None, -1


@dataclass(frozen=True)
class ServingConfig:
    """What the data plane needs of the stage's configuration (stages.worker.StageConfig says each)."""

    device: str
    max_message_bytes: int
    send_timeout_s: float
    emulate_speed: float
    emulate_slowdown: tuple[int, float] | None
    keys: StageKeys | None


class StepServer:
    def __init__(self, context: zmq.Context, config: ServingConfig, name: str, held: HeldSpan, stats: StageStats,
                 send_control: Callable[..., None], echo_peer: EchoPeer):
        self.context, self.config, self.name = context, config, name
        self.held, self.stats, self.send_control, self.echo_peer = held, stats, send_control, echo_peer
        self.data_out: zmq.Socket | None = None  # connected at the first send after an assignment
        self.next_hop: tuple[str, str | None] | None = None  # (address, CURVE server key) of the next hop
        self.busy_since: float | None = None  # when the running step began (None: idle)
        # Testing only: a step whose input tokens contain this id raises, as a poison item would.
        fail_on = os.environ.get("LAYERBUS_FAIL_ON_TOKEN", "")
        self.fail_on_token = int(fail_on) if fail_on.strip().lstrip("-").isdigit() else None

    def send_to(self, address: str, key: str | None) -> None:
        """Send to this hop from now on. The socket connects at the first send: steps come only once every
        stage is READY, so the next stage admits this one by then (a refused CURVE client never retries)."""
        if (address, key) != self.next_hop and self.data_out is not None:
            self.data_out.close(linger=0)
            self.data_out = None
        self.next_hop = (address, key)

    def _connect_next(self) -> None:
        address, key = self.next_hop
        data_out = self.context.socket(zmq.PUSH)
        data_out.setsockopt(zmq.LINGER, 0)
        data_out.setsockopt(zmq.SNDTIMEO, int(self.config.send_timeout_s * 1000))
        if key is not None:
            secure_client(data_out, self.config.keys.keypair, key.encode())
        try:
            data_out.connect(address)
        except zmq.ZMQError:
            data_out.close(linger=0)
            raise
        self.data_out = data_out

    def serve_one(self, frames) -> None:
        """Serve one message pulled from the data port."""
        if is_link_probe(frames):  # another stage timing its link to this one: not a step
            self.echo_peer.handle(frames)
            return
        emulating = self.config.emulate_speed < 1.0 or self.config.emulate_slowdown is not None
        timer = StepTimer(self.config.device, torch.get_num_threads()) if emulating else None
        started = self.busy_since = timer.started if timer is not None else time.monotonic()
        self.stats.bytes_in += sum(memoryview(frame).nbytes for frame in frames[1:])
        try:
            self._serve(frames, started, timer)
        finally:
            self.busy_since = None

    def _serve(self, frames, started: float, timer: StepTimer | None) -> None:
        try:
            message = self._validate(frames)
        except Exception as error:  # noqa: BLE001 - whatever a hostile message trips, it is rejected, not fatal
            if not isinstance(error, WireError):
                log.exception("stage %s: validation raised %s (a bug to report)", self.name, type(error).__name__)
                error = WireError(f"unreadable message ({type(error).__name__}: {error})")
            sender = _peer_address(frames[0])
            log.error("stage %s: rejected a message from %s: %s", self.name, sender, error)
            self.stats.rejected += 1
            self.send_control(protocol.REJECTED, sender=sender, error=str(error))
            return
        header = message.header
        tracer = self.held.tracer  # None unless the broker asked for a trace: then nothing below records
        marks = tracer.begin(started, self.stats.codec_s) if tracer is not None else None
        try:
            reply = self._run(message)
        except Exception as error:  # the step failed here; the broker decides what happens to its items
            log.exception("stage %s: step %s of micro-batch %s failed", self.name, header["step"], header["mb"])
            self.send_control(protocol.FAILURE, epoch=self.held.epoch, step=header["step"], mb=header["mb"],
                              attempt=header["attempt"], cause="step", error=f"{type(error).__name__}: {error}")
            return
        if marks is not None:
            marks.run_done(self.stats.codec_s)  # _run's growth of codec_s is its encoding
        speed = self._emulated_speed()
        if timer is not None and speed < 1.0:  # emulation: a device this much slower would still be computing
            time.sleep(timer.sleep_s(speed))
            if marks is not None:
                marks.sleep_done()
        try:
            if self.data_out is None:
                self._connect_next()
            self.data_out.send_multipart(reply, copy=False)
            self.stats.bytes_out += sum(memoryview(frame).nbytes for frame in reply[1:])
        except zmq.ZMQError as error:
            # Not the items' fault: the next stage is gone or stuck. The broker resends once it knows.
            why = f"timed out after {self.config.send_timeout_s} s" if isinstance(error, zmq.Again) else str(error)
            self.send_control(protocol.FAILURE, epoch=self.held.epoch, step=header["step"], mb=header["mb"],
                              attempt=header["attempt"], cause="send", error=f"send to {self.next_hop[0]} {why}")
        ended = time.monotonic()
        self.stats.observe_step(ended - started)
        if marks is not None:  # the step's spans end where busy_s stops counting: they add up to it
            tracer.record(marks, header, ended)

    def _emulated_speed(self) -> float:
        slowdown = self.config.emulate_slowdown
        if slowdown is not None and self.stats.steps >= slowdown[0]:
            return self.config.emulate_speed * slowdown[1]
        return self.config.emulate_speed

    def _validate(self, frames) -> Message:
        shard = self.held.shard
        if shard is None:
            decode(frames, self.config.max_message_bytes)  # a malformed message is named as such first
            raise WireError("step arrived before this stage was assigned layers")
        message, codec_s = validate_step(frames, StepExpectations(
            is_first=shard.spec.is_first, hidden_size=shard.config.hidden_size, epoch=self.held.epoch,
            max_message_bytes=self.config.max_message_bytes))
        self.stats.codec_s += codec_s
        return message

    def _run(self, message: Message) -> list:
        shard, arena = self.held.shard, self.held.arena
        header = message.header
        rows: list[StepRow] = header["parsed_rows"]
        for slot in header["release"]:
            if isinstance(slot, int) and 0 <= slot < arena.num_slots:
                arena.release(slot)
        inputs = next(iter(message.tensors.values()))
        if self.fail_on_token is not None and shard.spec.is_first and bool((inputs == self.fail_on_token).any()):
            raise ValueError(f"LAYERBUS_FAIL_ON_TOKEN: token {self.fail_on_token} in this step (a test's poison item)")
        prefix: protocol.PrefixOps = header["parsed_prefix"]
        arena.drop_prefixes(prefix.drop)
        for slot, entry, length in prefix.restore:
            arena.restore_prefix(entry, slot, length)
        window = header["parsed_window"]
        if window is None:
            hidden = run_step(shard, arena, rows, inputs)
            if not shard.spec.is_last:
                arena.store_outputs([r.slot for r in rows], [r.start for r in rows], [r.length for r in rows],
                                    hidden, shard.spec.layers.end)
        else:
            hidden = replay_step(shard, arena, rows, inputs, window)
        for slot, entry, length in prefix.save:
            arena.save_prefix(entry, slot, length)
        self.stats.tokens += int(inputs.shape[0])
        out_header = {key: header[key] for key in ("mb", "step", "attempt", "epoch")}
        if window is not None and shard.spec.is_last:
            return encode(dict(out_header, kind=protocol.RESULT, tokens=[]))  # a replay emits nothing
        if not shard.spec.is_last:
            out_header["rows"] = header["rows"]
            out_header["release"] = header["release"]
            for key in ("prefix", "window"):
                if key in header:
                    out_header[key] = header[key]
            if hidden is None:  # the replay does not reach the next stage, or has not begun: nothing to carry
                return encode(dict(out_header, kind=protocol.STEP))
            started = time.monotonic()
            codec_fields, tensors = codecs.pack("hidden", hidden, self.held.wire_codec)
            frames = encode(dict(out_header, kind=protocol.STEP, **codec_fields), tensors)
            self.stats.codec_s += time.monotonic() - started
            return frames
        return encode(dict(out_header, kind=protocol.RESULT, **last_stage_outputs(shard, rows, hidden)))

    def close(self) -> None:
        if self.data_out is not None:
            self.data_out.close(linger=0)


def _peer_address(frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return "an unknown sender"
