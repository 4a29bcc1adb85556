"""The stage process: register with the broker, load the layers it is told, serve steps.

A stage starts empty. It registers on the control plane (ROUTER/DEALER; stages/broker_link.py: it waits for
a broker that is not up yet, and leaves one that has fallen silent), loads the span the broker assigns,
reports READY, then pulls steps from its data socket and serves them (stages/step_server.py). It never dies
silently: a bad message is rejected and reported, a failed step or load is reported with its error text,
and it exits by itself when the broker has been silent for too long, or at once when the broker refuses
its key.

Secured (`StageConfig.keys`), every socket is CurveZMQ: the control and heartbeat DEALERs and the next-hop
PUSH are clients of keys the stage was given or the broker named; the data PULL is a server admitting only
the previous hop the assignment names, and peers it refuses are counted and reported (wire/curve.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass

import torch
import zmq

from layerbus.models.attention_shape import attention_shape
from layerbus.models.model_files import open_model_dir
from layerbus.stages.broker_link import BrokerLink, LinkConfig
from layerbus.stages.heartbeat import busy_for
from layerbus.stages.host import (budget_overrun, check_device, current_rss_bytes, large_allocations_mapped,
                                  peak_rss_bytes, release_freed_memory, reset_peak_rss, runtime_rss_bytes)
from layerbus.stages.kv_cache import KV_INITIAL_CAPACITY, KVArena
from layerbus.stages.peer_links import PeerProbeRequest, PeerProber, proven_key
from layerbus.stages.replay import CarryFrom
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.stages.step_server import STEP_SECONDS_BUCKETS, HeldSpan, ServingConfig, StageStats, StepServer
from layerbus.stages.tracing import StageTracer, untraced_flush
from layerbus.wire import codecs, protocol
from layerbus.wire.curve import CurveGate, StageKeys, secure_client, secure_server
from layerbus.wire.frames import DEFAULT_MAX_MESSAGE_BYTES, WireError
from layerbus.wire.link_probe import EchoPeer
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import choose_weights

log = logging.getLogger("layerbus.stage")
__all__ = ["STEP_SECONDS_BUCKETS", "StageConfig", "StageStats", "StageWorker", "run_stage"]


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
    broker_timeout_s: float = 15.0  # once the broker has spoken: exit when it has been silent this long
    wait_for_broker_s: float | None = None  # before it has spoken: give up after this long (None: no limit)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger data messages are rejected
    send_timeout_s: float = 60.0  # a send blocked this long (next stage gone) is reported
    emulate_speed: float = 1.0  # emulation: run at this fraction of the real speed (sleeps the rest)
    emulate_slowdown: tuple[int, float] | None = None  # emulation: (after this many steps, speed x this)
    # CURVE on every link (wire/curve.py): this stage's keypair and the broker's public key. None: its
    # links are neither authenticated nor encrypted (allowed on a loopback --bind, or with --insecure).
    keys: StageKeys | None = None

    def resolved_name(self) -> str:
        return self.name or f"{socket.gethostname()}-{os.getpid()}"

    def link(self) -> LinkConfig:
        return LinkConfig(self.broker, self.heartbeat_interval_s, self.broker_timeout_s, self.wait_for_broker_s,
                          self.keys)

    def serving(self) -> ServingConfig:
        return ServingConfig(self.device, self.max_message_bytes, self.send_timeout_s, self.emulate_speed,
                             self.emulate_slowdown, self.keys)


class StageWorker:
    def __init__(self, config: StageConfig):
        self.config = config
        self.name = config.resolved_name()
        self.stopping = False
        self.stopped_by_signal: int | None = None
        self.held = HeldSpan()
        self.stats = StageStats(started_at=time.monotonic(), device=config.device)
        self.context = zmq.Context()
        self.link = BrokerLink(self.context, config.link(), self.name, self._heartbeat_fields)
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
        self.steps = StepServer(self.context, config.serving(), self.name, self.held, self.stats, self.link.send,
                                self.echo_peer)
        self.loading_since: float | None = None  # when the running load began (None: not loading)
        self.runtime_bytes = 0  # resident memory before any load, measured when run() starts
        self.next_refusal_check = 0.0  # monotonic time to look at the data port's refused handshakes again

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> int:
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.data_in.bind(self.config.bind)
        data_address = self.config.advertise or self.data_in.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.prober = PeerProber(self.context, self.data_in.getsockopt(zmq.LAST_ENDPOINT).decode(), data_address,
                                 *((self._secure_peer, self._secure_answers) if self.gate is not None else ()))
        # What this process holds before any weight: interpreter, torch, libraries, sockets. A
        # --memory-budget counts it (stages/profile.py memory_figures), as the process's VmHWM does;
        # a stage forked from the launcher counts what the launcher held (launch/stage_forker.py).
        self.runtime_bytes = runtime_rss_bytes()
        self.link.registration = dict(
            name=self.name, device=self.config.device, dtype=self.config.dtype, weights=self.config.weights,
            threads=torch.get_num_threads(), memory_budget=self.config.memory_budget,
            emulate_speed=self.config.emulate_speed, data_address=data_address, pid=os.getpid(),
            host=socket.gethostname())
        self.link.connect()
        poller = zmq.Poller()
        poller.register(self.link.socket, zmq.POLLIN)
        poller.register(self.data_in, zmq.POLLIN)
        poller.register(self.link.handshakes, zmq.POLLIN)
        try:
            exit_code = self._loop(poller)
        except Exception as error:  # a bug or a broken device: say what it was before going
            log.exception("stage %s: stopping on an unexpected error", self.name)
            self.link.send(protocol.FAILURE, epoch=self.held.epoch, fatal=True,
                           error=f"stage stopped: {type(error).__name__}: {error}")
            exit_code = 1
        self.link.close(self.stats.to_json())
        self.echo_peer.close()
        self.steps.close()
        if self.gate is not None:
            self.gate.close()
        self.context.destroy(linger=0)
        log.info("stage %s stopped", self.name)
        # 128 + signal, as shells report a process a signal stopped, so a supervisor (run_cluster.sh)
        # can tell a Ctrl-C from a clean shutdown requested by the broker.
        return 128 + self.stopped_by_signal if self.stopped_by_signal else exit_code

    def _loop(self, poller: zmq.Poller) -> int:
        while not self.stopping:
            events = dict(poller.poll(int(self.config.heartbeat_interval_s * 1000)))
            if self.link.socket in events:
                self._handle_control()
            # Asked again: the control messages just handled may have served what the poll saw (a RESET
            # serves the old epoch's steps first), and a blocking receive on an empty socket would leave
            # this stage deaf to the broker while its heartbeats go on.
            if self.data_in in events and not self.stopping and self.data_in.poll(0):
                self.steps.serve_one(self.data_in.recv_multipart(copy=False))
            now = time.monotonic()
            if self.gate is not None and now >= self.next_refusal_check:
                self._report_refusals()
                self.next_refusal_check = now + 1.0
            gone = self.link.check()
            if gone is not None:
                log.error("stage %s: %s", self.name, gone.why)
                return gone.code
        return 0

    def request_stop(self, signum=None, _frame=None) -> None:
        if signum is not None:
            log.info("stage %s: received %s, stopping", self.name, signal.Signals(signum).name)
            self.stopped_by_signal = signum
        self.stopping = True

    def _report_refusals(self) -> None:
        """Peers the data port refused: counted, and each new one logged and told to the broker."""
        for refusal in self.gate.refusals():
            self.stats.refused += 1
            message = refusal.describe()
            if message not in self.refusals_seen and len(self.refusals_seen) < 1000:
                self.refusals_seen.add(message)
                log.warning("stage %s: data port %s", self.name, message)
                self.link.send(protocol.REJECTED, sender=refusal.address or "?", error=message, refused=True)

    # -- control plane --------------------------------------------------------------------------
    def _heartbeat_fields(self) -> dict:
        """Called from the heartbeat thread: reads the main loop's state, changes nothing."""
        busy_since = self.steps.busy_since if self.steps.busy_since is not None else self.loading_since
        fields = {"stats": self.stats.to_json(), "busy_s": round(busy_for(busy_since), 3), "epoch": self.held.epoch}
        arena = self.held.arena
        if arena is not None:  # what the prefix cache holds here (the broker bounds it in tokens)
            fields["stats"].update(prefix_tokens=arena.prefix_tokens, prefix_bytes=arena.prefix_bytes,
                                   prefix_tokens_peak=arena.prefix_tokens_peak,
                                   kv_capacity=arena.capacity)  # positions per slot the KV cache holds now
        tracer = self.held.tracer
        if tracer is not None:  # step records ride on the heartbeats: no extra messages, no extra port
            fields["trace"] = tracer.chunk()
        return fields

    def _handle_control(self) -> None:
        for message in self.link.receive():
            kind, header = message.kind, message.header
            if kind == protocol.ASSIGN:
                self._assign(header)
            elif kind == protocol.RESET:
                self._reset(header)
            elif kind == protocol.REDIRECT:
                self._move_to(header)
            elif kind == protocol.PROFILE:
                self.link.send(protocol.PROFILE_RESULT, **self._profile(header))
            elif kind == protocol.PROBE:
                self.link.send(protocol.PROBE_ECHO, seq=header.get("seq"))
            elif kind == protocol.LINK_ADMIT:
                self._link_admit(header)
            elif kind == protocol.LINK_PROBE:
                self.link.send(protocol.LINK_PROBE_RESULT, **self._link_probe(header))
            elif kind == protocol.SHUTDOWN:
                log.info("stage %s: shutdown requested by the broker", self.name)
                self.stopping = True
            elif kind == protocol.TRACE_FLUSH:
                self._flush_trace(header.get("id"))
            elif kind == protocol.HEARTBEAT and self.held.tracer is not None:
                self.held.tracer.broker_heartbeat(header.get("sent_us"))
            # otherwise heartbeats need nothing beyond being heard (BrokerLink.receive)

    def _reset(self, header: dict) -> None:
        """The broker presumed this stage dead (it went silent) and re-planned without it, or it is a new broker
        on this address that does not know this stage: drop the span, whose steps belong to a finished epoch
        (or another broker), and offer this stage again."""
        why = header.get("why") if isinstance(header.get("why"), str) else "the broker re-planned without this stage"
        log.warning("stage %s: %s; registering again", self.name, why)
        # Steps already received belong to the old epoch: serve them on the old span first, so their results
        # reach the broker, which discards them, rather than being rejected here (whether they came before the
        # RESET was a race that load decided).
        while not self.stopping and self.held.shard is not None and self.data_in.poll(0):
            self.steps.serve_one(self.data_in.recv_multipart(copy=False))
        self.held.drop()
        self.link.register()

    def _move_to(self, header: dict) -> None:
        """The front door of several chains (`layerbus broker --chains K`) sends this stage on to its chain's
        broker: the control socket and the heartbeats go there, and the stage registers again. Only an
        empty stage moves, unless its own chain's broker, giving up, sends it back to the front door with
        `release` (protocol.redirect_header)."""
        if self.held.shard is not None and header.get("release") is not True:
            log.warning("stage %s: a redirect while holding layers, ignored: %s", self.name, header)
            return
        try:
            endpoint = protocol.redirected_endpoint(self.link.config.broker, header)
        except WireError as error:
            log.error("stage %s: %s", self.name, error)
            return
        if self.held.shard is not None:
            # Its chain gave up (it cannot hold the model without a lost stage): the span and its caches go,
            # and so do steps still queued for it, whose chain no longer waits for their results.
            log.warning("stage %s: its chain's broker gave up; dropping layers %s and going back to %s",
                        self.name, self.held.shard.spec.layers, endpoint)
            while self.data_in.poll(0):
                self.data_in.recv_multipart(copy=False)
            self.held.drop()
            release_freed_memory()
            self.link.left_chain = True  # said once to the front door, which then sends it to another chain
        log.info("stage %s: %s sends this stage to %s", self.name, self.link.config.broker, endpoint)
        self.link.move_to(endpoint)

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
            self.loading_since = started
            weights = choose_weights(self.config.weights, header.get("weights", "auto"), self.config.dtype)
            spec = ShardSpec(LayerRange.from_json(header["layers"]), header["is_first"], header["is_last"],
                             self.config.device, weights.dtype, weights.quantize_to, native=weights.name == "native")
            # Drop the old span before loading the new one; its caches wait to be carried over (below).
            old_shard, old_arena = self.held.shard, self.held.arena
            self.held.drop()
            # keep_caches false (--no-keep-caches): nothing carried, nothing kept of what is sent.
            keep = header.get("keep_caches", True) is not False
            carry = CarryFrom.of(old_shard, old_arena, self.held.loaded_as, (header["model_dir"], weights.name)) if keep else None
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
            self.steps.send_to(protocol.require_endpoint(header["next_address"], "next_address"), next_key)
            # Only a fully set-up stage serves the new epoch: a failure above leaves it serving none.
            held = self.held
            held.shard, held.arena, held.epoch = shard, arena, header["epoch"]
            held.loaded_as = (header["model_dir"], weights.name)
            held.wire_codec = wire_codec
            # Asked again in every assignment, so a broker started without --trace turns it off; records
            # of earlier epochs not shipped yet are kept.
            held.tracer = (held.tracer or StageTracer()) if header.get("trace") is True else None
            log.info("stage %s loaded layers %s of %s as %s in %.2f s (%d weight bytes)", self.name, spec.layers,
                     header["model_dir"], weights.describe(shard.block_layouts()), time.monotonic() - started, shard.parameter_bytes())
            # On a CPU the budget is the process's resident memory, which VmHWM measures (on a GPU, device memory).
            overrun = budget_overrun(peak_rss_bytes(), self.config.memory_budget if shard.device.type == "cpu" else None,
                                     rss_before, shard.parameter_bytes())
            if overrun is not None:
                log.warning("stage %s, loading layers %s: %s", self.name, spec.layers, overrun)
            self.link.send(protocol.READY, epoch=held.epoch, layers=spec.layers.to_json(),
                               param_bytes=shard.parameter_bytes(), weights=weights.describe(shard.block_layouts()),
                               load_s=time.monotonic() - started,
                               peak_rss=peak_rss_bytes(), rss_before_load=rss_before,
                               **(kept.to_json() if kept is not None else {}))
        except Exception as error:  # any load failure is reported with its text; the stage stays up
            log.exception("stage %s: assignment failed", self.name)
            self.link.send(protocol.FAILURE, epoch=header.get("epoch"), error=f"{type(error).__name__}: {error}")
        finally:
            self.loading_since = None

    def _flush_trace(self, flush_id: object) -> None:
        """Ship every step record left; the last message carries the stats they add up to."""
        tracer = self.held.tracer
        payloads = tracer.flush(flush_id) if tracer is not None else [untraced_flush(flush_id)]
        for payload in payloads:
            self.link.send(protocol.TRACE, trace=payload, stats=self.stats.to_json())

    def _profile(self, header: dict) -> dict:
        from layerbus.stages.profile import ProfileRequest, profile_stage

        _hold_while(os.environ.get("LAYERBUS_HOLD_PROFILE_WHILE", ""))
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
        self.link.send(protocol.LINK_ADMITTED)

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


def _hold_while(path: str, limit_s: float = 120.0) -> None:
    """For tests only (LAYERBUS_HOLD_LOAD_WHILE=PATH before loading a span, LAYERBUS_HOLD_PROFILE_WHILE=PATH
    before profiling): wait while PATH exists, so a test can kill a stage that is certainly mid-load or
    mid-profile, or hold the broker waiting on it. Heartbeats go on meanwhile, as in a long load."""
    deadline = time.monotonic() + limit_s
    while path and os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


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
