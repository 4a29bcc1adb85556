"""The stage process: register with the broker, load the layers it is told, serve steps.

A stage starts empty. It registers on the control plane (ROUTER/DEALER), loads the span the broker
assigns, reports READY, then pulls steps from its data socket, runs them and pushes the result to
the next stage (or, on the last stage, the chosen tokens to the broker). It never dies silently:
a bad message is rejected and reported, a failed step is reported with its error text, and it
exits by itself when the broker has been silent for too long, or at once when the broker refuses its key.

Secured (`StageConfig.keys`), every socket is CurveZMQ: the control and heartbeat DEALERs and the next-hop
PUSH are clients of keys the stage was given or the broker named; the data PULL is a server admitting only
the previous hop the assignment names, and peers it refuses are counted and reported (wire/curve.py).
"""

from __future__ import annotations

import bisect
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field, replace

import torch
import zmq

from layerbus.models.attention_shape import attention_shape
from layerbus.models.model_files import open_model_dir
from layerbus.stages.emulation import StepTimer
from layerbus.stages.forward import run_step
from layerbus.stages.heartbeat import HeartbeatThread, busy_for
from layerbus.stages.host import (budget_overrun, check_device, current_rss_bytes, device_memory_bytes, peak_rss_bytes,
                                  large_allocations_mapped, release_freed_memory, reset_peak_rss,
                                  runtime_rss_bytes)
from layerbus.stages.kv_cache import KV_INITIAL_CAPACITY, KVArena
from layerbus.stages.replay import CarryFrom, replay_step
from layerbus.stages.peer_links import PeerProbeRequest, PeerProber, is_link_probe, proven_key
from layerbus.stages.sampling import last_stage_outputs
from layerbus.stages.shard import ShardSpec, StageShard, load_shard
from layerbus.stages.step_validation import StepExpectations, validate_step
from layerbus.stages.tracing import StageTracer, untraced_flush
from layerbus.wire import codecs, protocol
from layerbus.wire.curve import CurveGate, StageKeys, handshake_failure, secure_client, secure_server, watch_handshakes
from layerbus.wire.frames import DEFAULT_MAX_MESSAGE_BYTES, Message, WireError, decode, encode
from layerbus.wire.link_probe import EchoPeer
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import choose_weights

log = logging.getLogger("layerbus.stage")


@dataclass(frozen=True)
class StageConfig:
    """How one stage process runs."""

    broker: str  # the broker's control endpoint, e.g. tcp://10.0.0.5:5555
    name: str = ""  # unique stage name (default: host-pid)
    bind: str = "tcp://127.0.0.1:*"  # where this stage receives steps; "*" port = any free port
    advertise: str | None = None  # address other machines use to reach `bind` (default: as bound)
    device: str = "cpu"  # cpu, cuda:N or mps
    dtype: str = "float32"  # float32, bfloat16 or float16
    weights: str | None = None  # --weights (wire.weight_formats); None = what the broker's assignment says
    threads: int = 0  # torch intra-op threads (0 = torch's default)
    memory_budget: int | None = None  # the stage's whole memory in bytes, runtime included (None = not set)
    emulate_memory: int | None = None  # emulation: bytes for weights, KV cache and workspace, as a smaller device
    heartbeat_interval_s: float = 0.5  # control-plane heartbeat period
    broker_timeout_s: float = 15.0  # exit when the broker has been silent this long
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger data messages are rejected
    send_timeout_s: float = 60.0  # a send blocked this long (next stage gone) is reported
    emulate_speed: float = 1.0  # emulation: run at this fraction of the real speed (sleeps the rest)
    emulate_slowdown: tuple[int, float] | None = None  # emulation: (after this many steps, speed x this)
    # CURVE on every link (wire/curve.py): this stage's keypair and the broker's public key. None: its
    # links are neither authenticated nor encrypted (allowed on a loopback --bind, or with --insecure).
    keys: StageKeys | None = None

    def resolved_name(self) -> str:
        return self.name or f"{socket.gethostname()}-{os.getpid()}"


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


class StageWorker:
    def __init__(self, config: StageConfig):
        self.config = config
        self.name = config.resolved_name()
        self.stopping = False
        self.stopped_by_signal: int | None = None
        self.shard: StageShard | None = None
        self.left_chain = False  # its chain's broker gave up and sent it back to the front door
        self.arena: KVArena | None = None
        self.loaded_as: tuple[str, str] | None = None  # (model directory, weight format) of the loaded span
        self.epoch = -1
        self.stats = StageStats(started_at=time.monotonic(), device=config.device)
        self.context = zmq.Context()
        self.control = self.context.socket(zmq.DEALER)
        self.control.setsockopt(zmq.IDENTITY, self.name.encode())
        self.control.setsockopt(zmq.LINGER, 0)
        self._secure_client(self.control)
        self.control_handshakes = watch_handshakes(self.control)  # the broker refused us: say so and stop
        self.admitted = False  # heard from the broker at least once
        self.failed_handshake: str | None = None  # why the last handshake failed before we were admitted
        self.data_in = self.context.socket(zmq.PULL)
        self.data_in.setsockopt(zmq.LINGER, 0)
        # Secured: the data port admits only the hop before this stage, as the assignment names it.
        self.gate = CurveGate(self.context, config.keys.keypair) if config.keys is not None else None
        if self.gate is not None:
            self.gate.guard(self.data_in)
        self.refusals_seen: set[str] = set()
        self.data_port_keys: list[bytes] = []  # secured: the client keys the last assignment admitted (its hop before)
        # Other stages' link probes arriving on the data port are answered here (stages/peer_links.py).
        self.echo_peer = EchoPeer(self.context, secure_reply=self._secure_answer if self.gate is not None else None)
        self.data_out: zmq.Socket | None = None  # connected at the first send after an assignment
        self.next_hop: tuple[str, str | None] | None = None  # (address, CURVE server key) of the next hop
        self.busy_since: float | None = None  # when the running step or load began (None: idle)
        self.heartbeats: HeartbeatThread | None = None
        # Testing only: a step whose input tokens contain this id raises, as a poison item would.
        fail_on = os.environ.get("LAYERBUS_FAIL_ON_TOKEN", "")
        self.fail_on_token = int(fail_on) if fail_on.strip().lstrip("-").isdigit() else None
        self.wire_codec = codecs.DEFAULT_CODEC  # how outgoing hidden states travel (the broker's ASSIGN says)
        self.tracer: StageTracer | None = None  # step records, only while the broker asks (ASSIGN's trace)
        self.runtime_bytes = 0  # resident memory before any load, measured when run() starts
        self.next_refusal_check = 0.0  # monotonic time to look at the data port's refused handshakes again

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> int:
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.data_in.bind(self.config.bind)
        data_address = self.config.advertise or self.data_in.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.control.connect(self.config.broker)
        self.data_address = data_address
        self.prober = PeerProber(self.context, self.data_in.getsockopt(zmq.LAST_ENDPOINT).decode(), data_address,
                                 *((self._secure_peer, self._secure_answers) if self.gate is not None else ()))
        # What this process holds before any weight: interpreter, torch, libraries, sockets. A
        # --memory-budget counts it (stages/profile.py memory_figures), as the process's VmHWM does;
        # a stage forked from the launcher counts what the launcher held (launch/stage_forker.py).
        self.runtime_bytes = runtime_rss_bytes()
        self._register()
        self._start_heartbeats()
        self.last_heard = time.monotonic()
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.data_in, zmq.POLLIN)
        poller.register(self.control_handshakes, zmq.POLLIN)
        try:
            exit_code = self._loop(poller)
        except Exception as error:  # a bug or a broken device: say what it was before going
            log.exception("stage %s: stopping on an unexpected error", self.name)
            self._send_control(protocol.FAILURE, epoch=self.epoch, fatal=True,
                               error=f"stage stopped: {type(error).__name__}: {error}")
            exit_code = 1
        self.heartbeats.stop()
        try:  # without a link (the broker refused this stage) there is no one to say goodbye to: no waiting
            self.control.send_multipart(encode({"kind": protocol.BYE, "stats": self.stats.to_json()}),
                                        flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
        self.echo_peer.close()
        if self.gate is not None:
            self.gate.close()
        self.context.destroy(linger=0)
        log.info("stage %s stopped", self.name)
        # 128 + signal, as shells report a process a signal stopped, so a supervisor (run_cluster.sh)
        # can tell a Ctrl-C from a clean shutdown requested by the broker.
        return 128 + self.stopped_by_signal if self.stopped_by_signal else exit_code

    def _loop(self, poller: zmq.Poller) -> int:
        while not self.stopping:
            timeout_ms = int(self.config.heartbeat_interval_s * 1000)
            events = dict(poller.poll(timeout_ms))
            if self.control in events:
                self._drain_control()
            # Asked again: the control messages just handled may have served what the poll saw (a RESET
            # serves the old epoch's steps first), and a blocking receive on an empty socket would leave
            # this stage deaf to the broker while its heartbeats go on.
            if self.data_in in events and not self.stopping and self.data_in.poll(0):
                self._serve_one()
            if self.control_handshakes in events and self._broker_refused():
                return 2
            now = time.monotonic()
            if self.gate is not None and now >= self.next_refusal_check:
                self._report_refusals()
                self.next_refusal_check = now + 1.0
            silent = now - self.last_heard
            if silent > self.config.broker_timeout_s and self.control.poll(0):
                # A long step (a slow CPU, a send waiting on a slow link) kept the broker's messages
                # waiting in the socket: they were on time, so they count before silence is judged.
                self._drain_control()
                silent = time.monotonic() - self.last_heard
            if silent > self.config.broker_timeout_s and self.failed_handshake is not None:
                # Never admitted: libzmq's retries kept failing (a keyless stage may see only broken pipes
                # from a secured broker, never the telling "mechanism mismatch"), so this is no link at all.
                log.error("stage %s: no link to the broker at %s after %.1f s: %s; a secured broker needs this "
                          "stage's --keys and --broker-key", self.name, self.config.broker, silent,
                          self.failed_handshake)
                return 2
            if silent > self.config.broker_timeout_s:
                log.error("stage %s: broker %s silent for %.1f s; exiting", self.name, self.config.broker, silent)
                return 3
        return 0

    def _broker_refused(self) -> bool:
        """A failed handshake with the broker, logged; True when it is for good (libzmq will not retry)."""
        failure = handshake_failure(self.control_handshakes)
        if failure is None:
            return False
        why, for_good = failure
        if not self.admitted:
            self.failed_handshake = why
        (log.error if for_good else log.warning)(
            "stage %s: no link to the broker at %s: %s; a secured broker needs this stage's --keys (its NAME.key "
            "copied into the broker's --allow folder) and --broker-key (the broker's NAME.key)",
            self.name, self.config.broker, why)
        return for_good

    def _secure_client(self, socket: zmq.Socket) -> None:
        """A control socket (this loop's or the heartbeat thread's) as a CURVE client of the broker."""
        if self.config.keys is not None:
            secure_client(socket, self.config.keys.keypair, self.config.keys.broker)

    def _report_refusals(self) -> None:
        """Peers the data port refused: counted, and each new one logged and told to the broker."""
        for refusal in self.gate.refusals():
            self.stats.refused += 1
            message = refusal.describe()
            if message not in self.refusals_seen and len(self.refusals_seen) < 1000:
                self.refusals_seen.add(message)
                log.warning("stage %s: data port %s", self.name, message)
                self._send_control(protocol.REJECTED, sender=refusal.address or "?", error=message, refused=True)

    def request_stop(self, signum=None, _frame=None) -> None:
        if signum is not None:
            log.info("stage %s: received %s, stopping", self.name, signal.Signals(signum).name)
            self.stopped_by_signal = signum
        self.stopping = True

    # -- control plane --------------------------------------------------------------------------
    def _register(self) -> None:
        extra = {"left_chain": True} if self.left_chain else {}
        self.left_chain = False
        self._send_control(protocol.REGISTER, name=self.name, device=self.config.device, dtype=self.config.dtype,
                           weights=self.config.weights, threads=torch.get_num_threads(), memory_budget=self.config.memory_budget,
                           emulate_speed=self.config.emulate_speed,
                           data_address=self.data_address, pid=os.getpid(), host=socket.gethostname(), **extra)
        log.info("stage %s registered with %s, receiving on %s", self.name, self.config.broker, self.data_address)

    def _heartbeat_fields(self) -> dict:
        """Called from the heartbeat thread: reads the main loop's state, changes nothing."""
        fields = {"stats": self.stats.to_json(), "busy_s": round(busy_for(self.busy_since), 3), "epoch": self.epoch}
        arena = self.arena
        if arena is not None:  # what the prefix cache holds here (the broker bounds it in tokens)
            fields["stats"].update(prefix_tokens=arena.prefix_tokens, prefix_bytes=arena.prefix_bytes,
                                   prefix_tokens_peak=arena.prefix_tokens_peak,
                                   kv_capacity=arena.capacity)  # positions per slot the KV cache holds now
        tracer = self.tracer
        if tracer is not None:  # step records ride on the heartbeats: no extra messages, no extra port
            fields["trace"] = tracer.chunk()
        return fields

    def _send_control(self, kind: str, **fields) -> None:
        self.control.send_multipart(encode(dict(fields, kind=kind)), copy=False)

    def _drain_control(self) -> None:
        while self.control.poll(0):
            frames = self.control.recv_multipart(copy=False)
            self.last_heard, self.admitted = time.monotonic(), True
            try:
                message = decode(frames, 1 << 20)
            except WireError as error:
                log.error("stage %s: malformed control message from the broker: %s", self.name, error)
                continue
            if message.kind == protocol.ASSIGN:
                self._assign(message.header)
            elif message.kind == protocol.RESET:
                # The broker presumed this stage dead (it went silent) and re-planned without it: drop
                # the span, whose steps belong to a finished epoch, and offer this stage again.
                log.warning("stage %s: the broker re-planned without this stage; registering again", self.name)
                # Steps already received belong to the old epoch: serve them on the old span first, so
                # their results reach the broker, which discards them, rather than being rejected here
                # (whether they came before the RESET was a race that load decided).
                while not self.stopping and self.shard is not None and self.data_in.poll(0):
                    self._serve_one()
                self.shard, self.arena, self.epoch = None, None, -1
                self._register()
            elif message.kind == protocol.REDIRECT:
                self._move_to(message.header)
            elif message.kind == protocol.PROFILE:
                self._send_control(protocol.PROFILE_RESULT, **self._profile(message.header))
            elif message.kind == protocol.PROBE:
                self._send_control(protocol.PROBE_ECHO, seq=message.header.get("seq"))
            elif message.kind == protocol.LINK_ADMIT:
                self._link_admit(message.header)
            elif message.kind == protocol.LINK_PROBE:
                self._send_control(protocol.LINK_PROBE_RESULT, **self._link_probe(message.header))
            elif message.kind == protocol.SHUTDOWN:
                log.info("stage %s: shutdown requested by the broker", self.name)
                self.stopping = True
            elif message.kind == protocol.TRACE_FLUSH:
                self._flush_trace(message.header.get("id"))
            elif message.kind == protocol.HEARTBEAT and self.tracer is not None:
                self.tracer.broker_heartbeat(message.header.get("sent_us"))
            # otherwise heartbeats need nothing beyond last_heard

    def _move_to(self, header: dict) -> None:
        """The front door of several chains (`layerbus broker --chains K`) sends this stage on to its chain's
        broker: the control socket and the heartbeats go there, and the stage registers again. Only an
        empty stage moves, unless its own chain's broker, giving up, sends it back to the front door with
        `release` (protocol.redirect_header)."""
        if self.shard is not None and header.get("release") is not True:
            log.warning("stage %s: a redirect while holding layers, ignored: %s", self.name, header)
            return
        try:
            endpoint = protocol.redirected_endpoint(self.config.broker, header)
        except WireError as error:
            log.error("stage %s: %s", self.name, error)
            return
        if self.shard is not None:
            # Its chain gave up (it cannot hold the model without a lost stage): the span and its caches go,
            # and so do steps still queued for it, whose chain no longer waits for their results.
            log.warning("stage %s: its chain's broker gave up; dropping layers %s and going back to %s",
                        self.name, self.shard.spec.layers, endpoint)
            while self.data_in.poll(0):
                self.data_in.recv_multipart(copy=False)
            self.shard, self.arena, self.epoch = None, None, -1
            release_freed_memory()
            self.left_chain = True  # said once to the front door, which then sends it to another chain
        log.info("stage %s: %s sends this stage to %s", self.name, self.config.broker, endpoint)
        self.control.disconnect(self.config.broker)
        self.control.connect(endpoint)
        self.config = replace(self.config, broker=endpoint)
        if self.heartbeats is not None:
            self.heartbeats.stop()
        self._start_heartbeats()
        self._register()

    def _start_heartbeats(self) -> None:
        self.heartbeats = HeartbeatThread(self.context, self.config.broker, self.name.encode(),
                                          self.config.heartbeat_interval_s, self._heartbeat_fields,
                                          self._secure_client)
        self.heartbeats.start()

    def _assign(self, header: dict) -> None:
        try:
            protocol.require_fields(header, "assign", {"epoch": int, "model_dir": str, "layers": list,
                                                       "is_first": bool, "is_last": bool, "next_address": str,
                                                       "num_slots": int, "max_context": int})
            wire_codec = codecs.check_codec_name(header.get("wire", codecs.DEFAULT_CODEC))
            context_hint = header.get("context_hint", 0)
            if not isinstance(context_hint, int) or isinstance(context_hint, bool) or context_hint < 0:
                raise ValueError(f"assign: context_hint must be an integer >= 0, got {context_hint!r}")
            next_key = self._admit(header)
            release_freed_memory()  # what earlier work freed (a profile, a load's temporaries) leaves the figures
            reset_peak_rss()
            started, rss_before = time.monotonic(), current_rss_bytes()
            self.busy_since = started
            weights = choose_weights(self.config.weights, header.get("weights", "auto"), self.config.dtype)
            spec = ShardSpec(LayerRange.from_json(header["layers"]), header["is_first"], header["is_last"],
                             self.config.device, weights.dtype, weights.quantize_to, native=weights.name == "native")
            # Drop the old span before loading the new one; its caches wait to be carried over (below).
            old_shard, old_arena = self.shard, self.arena
            self.shard, self.arena, self.epoch = None, None, -1
            # keep_caches false (--no-keep-caches): nothing carried, nothing kept of what is sent.
            keep = header.get("keep_caches", True) is not False
            carry = CarryFrom.of(old_shard, old_arena, self.loaded_as, (header["model_dir"], weights.name)) if keep else None
            del old_shard, old_arena  # the old weights (and caches not carried) go before the new span is read
            _hold_while(os.environ.get("LAYERBUS_HOLD_LOAD_WHILE", ""))
            with large_allocations_mapped():
                shard = load_shard(open_model_dir(header["model_dir"]), spec)
                shape = attention_shape(shard.config)
                # A stage that sends on keeps what it sends, for the replay after a re-plan (broker.replay_window).
                # Sized for the job's longest sequence where the broker knows it (context_hint), so that no
                # step stalls the chain while the cache doubles; else from 128 positions, grown as needed.
                arena = KVArena(list(spec.layers), header["num_slots"], shape.kv_heads, shape.head_dim,
                                shard.dtype, shard.device, header["max_context"],
                                initial_capacity=max(KV_INITIAL_CAPACITY, context_hint),
                                outputs_size=0 if spec.is_last or not keep else shard.config.hidden_size,
                                allocate=carry is None)
            kept = carry.into(arena, spec.layers) if carry is not None else None
            del carry
            self._next_hop(protocol.require_endpoint(header["next_address"], "next_address"), next_key)
            # Only a fully set-up stage serves the new epoch: a failure above leaves it serving none.
            self.shard, self.arena, self.epoch = shard, arena, header["epoch"]
            self.loaded_as = (header["model_dir"], weights.name)
            self.wire_codec = wire_codec
            # Asked again in every assignment, so a broker started without --trace turns it off; records
            # of earlier epochs not shipped yet are kept.
            self.tracer = (self.tracer or StageTracer()) if header.get("trace") is True else None
            log.info("stage %s loaded layers %s of %s as %s in %.2f s (%d weight bytes)", self.name, spec.layers,
                     header["model_dir"], weights.describe(shard.block_layouts()), time.monotonic() - started, shard.parameter_bytes())
            # On a CPU the budget is the process's resident memory, which VmHWM measures (on a GPU, device memory).
            overrun = budget_overrun(peak_rss_bytes(), self.config.memory_budget if shard.device.type == "cpu" else None,
                                     rss_before, shard.parameter_bytes())
            if overrun is not None:
                log.warning("stage %s, loading layers %s: %s", self.name, spec.layers, overrun)
            self._send_control(protocol.READY, epoch=self.epoch, layers=spec.layers.to_json(),
                               param_bytes=shard.parameter_bytes(), weights=weights.describe(shard.block_layouts()),
                               load_s=time.monotonic() - started,
                               peak_rss=peak_rss_bytes(), rss_before_load=rss_before,
                               **(kept.to_json() if kept is not None else {}))
        except Exception as error:  # any load failure is reported with its text; the stage stays up
            log.exception("stage %s: assignment failed", self.name)
            self._send_control(protocol.FAILURE, epoch=header.get("epoch"), error=f"{type(error).__name__}: {error}")
        finally:
            self.busy_since = None

    def _flush_trace(self, flush_id: object) -> None:
        """Ship every step record left; the last message carries the stats they add up to."""
        payloads = self.tracer.flush(flush_id) if self.tracer is not None else [untraced_flush(flush_id)]
        for payload in payloads:
            self._send_control(protocol.TRACE, trace=payload, stats=self.stats.to_json())

    def _emulated_speed(self) -> float:
        slowdown = self.config.emulate_slowdown
        if slowdown is not None and self.stats.steps >= slowdown[0]:
            return self.config.emulate_speed * slowdown[1]
        return self.config.emulate_speed

    def _profile(self, header: dict) -> dict:
        from layerbus.stages.profile import ProfileRequest, profile_stage

        try:
            return profile_stage(ProfileRequest.from_header(header), self.config.device, self.config.dtype,
                                 torch.get_num_threads(), self.config.emulate_speed, self.config.memory_budget,
                                 runtime_bytes=self.runtime_bytes, emulate_memory=self.config.emulate_memory,
                                 own_weights=self.config.weights)
        except Exception as error:  # reported to the broker, which cannot plan without it; the stage stays up
            log.exception("stage %s: profiling failed", self.name)
            return {"error": f"{type(error).__name__}: {error}"}

    def _admit(self, header: dict) -> str | None:
        """Secured: admit only the assignment's previous hop to the data port, before READY (so before any
        step is sent); the next hop's server key. None on an unsecured stage."""
        if self.gate is None:
            return None
        protocol.require_fields(header, "assign", {"next_key": str, "prev_key": str})
        keys = (header["next_key"].encode(), header["prev_key"].encode())
        if any(len(key) != 40 for key in keys):
            raise WireError(f"assign's next_key and prev_key must be 40-character Z85 CURVE keys, got "
                            f"{header['next_key']!r:.50} and {header['prev_key']!r:.50}")
        self.data_port_keys = [keys[1]]
        self.gate.admit(self.data_port_keys)
        return header["next_key"]

    # -- link probes (stages/peer_links.py) ------------------------------------------------------
    def _link_admit(self, header: dict) -> None:
        """Secured: admit the probing stages' keys to the data port too, until the next assignment."""
        keys = header.get("keys")
        if self.gate is not None and isinstance(keys, list) and all(isinstance(k, str) and len(k) == 40 for k in keys):
            self.gate.admit(self.data_port_keys + [key.encode() for key in keys])
        self._send_control(protocol.LINK_ADMITTED)

    def _link_probe(self, header: dict) -> dict:
        try:
            request = PeerProbeRequest.from_header(header)
        except WireError as error:
            log.error("stage %s: bad link_probe request: %s", self.name, error)
            return {"error": str(error)}
        links = self.prober.probe(request)
        for link in links:
            if "error" in link:
                log.warning("stage %s: could not time the link to %s: %s", self.name, link["peer"], link["error"])
        return {"links": links}

    def _secure_peer(self, socket: zmq.Socket, peer_key: bytes) -> None:
        secure_client(socket, self.config.keys.keypair, peer_key)

    def _secure_answers(self, socket: zmq.Socket) -> None:
        secure_server(socket, self.config.keys.keypair)

    def _secure_answer(self, socket: zmq.Socket, probe_frame) -> None:
        """A probe's answers go back as a CURVE client of the key the probe's handshake proved."""
        key = proven_key(probe_frame)
        if key is not None:
            secure_client(socket, self.config.keys.keypair, key)

    def _next_hop(self, address: str, key: str | None) -> None:
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

    # -- data plane -----------------------------------------------------------------------------
    def _serve_one(self) -> None:
        frames = self.data_in.recv_multipart(copy=False)
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
            self._send_control(protocol.REJECTED, sender=sender, error=str(error))
            return
        header = message.header
        tracer = self.tracer  # None unless the broker asked for a trace: then nothing below records
        marks = tracer.begin(started, self.stats.codec_s) if tracer is not None else None
        try:
            reply = self._run(message)
        except Exception as error:  # the step failed here; the broker decides what happens to its items
            log.exception("stage %s: step %s of micro-batch %s failed", self.name, header["step"], header["mb"])
            self._send_control(protocol.FAILURE, epoch=self.epoch, step=header["step"], mb=header["mb"],
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
            self._send_control(protocol.FAILURE, epoch=self.epoch, step=header["step"], mb=header["mb"],
                               attempt=header["attempt"], cause="send", error=f"send to {self.next_hop[0]} {why}")
        ended = time.monotonic()
        self.stats.observe_step(ended - started)
        if marks is not None:  # the step's spans end where busy_s stops counting: they add up to it
            tracer.record(marks, header, ended)

    def _validate(self, frames) -> Message:
        if self.shard is None:
            decode(frames, self.config.max_message_bytes)  # a malformed message is named as such first
            raise WireError("step arrived before this stage was assigned layers")
        message, codec_s = validate_step(frames, StepExpectations(
            is_first=self.shard.spec.is_first, hidden_size=self.shard.config.hidden_size, epoch=self.epoch,
            max_message_bytes=self.config.max_message_bytes))
        self.stats.codec_s += codec_s
        return message

    def _run(self, message: Message) -> list:
        header = message.header
        rows: list[StepRow] = header["parsed_rows"]
        for slot in header["release"]:
            if isinstance(slot, int) and 0 <= slot < self.arena.num_slots:
                self.arena.release(slot)
        inputs = next(iter(message.tensors.values()))
        if self.fail_on_token is not None and self.shard.spec.is_first and bool((inputs == self.fail_on_token).any()):
            raise ValueError(f"LAYERBUS_FAIL_ON_TOKEN: token {self.fail_on_token} in this step (a test's poison item)")
        prefix: protocol.PrefixOps = header["parsed_prefix"]
        self.arena.drop_prefixes(prefix.drop)
        for slot, entry, length in prefix.restore:
            self.arena.restore_prefix(entry, slot, length)
        window = header["parsed_window"]
        if window is None:
            hidden = run_step(self.shard, self.arena, rows, inputs)
            if not self.shard.spec.is_last:
                self.arena.store_outputs([r.slot for r in rows], [r.start for r in rows], [r.length for r in rows],
                                         hidden, self.shard.spec.layers.end)
        else:
            hidden = replay_step(self.shard, self.arena, rows, inputs, window)
        for slot, entry, length in prefix.save:
            self.arena.save_prefix(entry, slot, length)
        self.stats.tokens += int(inputs.shape[0])
        out_header = {key: header[key] for key in ("mb", "step", "attempt", "epoch")}
        if window is not None and self.shard.spec.is_last:
            return encode(dict(out_header, kind=protocol.RESULT, tokens=[]))  # a replay emits nothing
        if not self.shard.spec.is_last:
            out_header["rows"] = header["rows"]
            out_header["release"] = header["release"]
            for key in ("prefix", "window"):
                if key in header:
                    out_header[key] = header[key]
            if hidden is None:  # the replay does not reach the next stage, or has not begun: nothing to carry
                return encode(dict(out_header, kind=protocol.STEP))
            started = time.monotonic()
            codec_fields, tensors = codecs.pack("hidden", hidden, self.wire_codec)
            frames = encode(dict(out_header, kind=protocol.STEP, **codec_fields), tensors)
            self.stats.codec_s += time.monotonic() - started
            return frames
        return encode(dict(out_header, kind=protocol.RESULT, **last_stage_outputs(self.shard, rows, hidden)))


def _hold_while(path: str, limit_s: float = 120.0) -> None:
    """For tests only (LAYERBUS_HOLD_LOAD_WHILE=PATH): wait while PATH exists before loading a span, so a
    test can kill a stage that is certainly mid-load. Heartbeats go on meanwhile, as in a long load."""
    deadline = time.monotonic() + limit_s
    while path and os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _peer_address(frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return "an unknown sender"


def run_stage(config: StageConfig) -> int:
    """Entry point for `layerbus stage`: runs until shutdown, a signal, or a silent broker."""
    try:
        check_device(config.device, config.dtype)
    except ValueError as error:
        log.error("%s", error)
        return 2
    worker = StageWorker(config)
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    return worker.run()
