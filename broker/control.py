"""The broker's control plane: a ROUTER socket where stages register, get their spans, heartbeat
and report failures. The socket is served on a thread of its own (broker/control_io.py), so the broker
answers and heartbeats whatever its main loop is doing; this class judges what arrived, on the main
loop's thread, when it polls. It keeps one `StageInfo` per stage (what the stage is and how it is doing; which
layers it serves is the broker's `Placement`), decides in one place when a stage is lost
(`lost_reason`), and hands the pipeline loop the events it must act on. Where the broker started the
stage processes itself (a LocalCluster), `children` tells it which of them ended, and why.

With keys (wire.curve.ClusterKeys), the ROUTER is a CURVE server admitting only the allowed stage keys;
a stage's key is read from its registration's connection (the handshake proved it), and each stage is
told the key of the hop it sends to and of the one allowed to send to it. Peers refused in the
handshake, here or at a stage's data port, are logged once each and queued in `refusals` for the
job's events."""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Sequence

import zmq

from layerbus.broker.control_io import LINK_TIMED, Arrival, ControlIO
from layerbus.broker.stage_info import (  # noqa: F401 - the control plane's vocabulary, imported from here too
    ChildWatch,
    ClusterError,
    ControlEvent,
    StageExit,
    StageInfo,
    StageLost,
    StagesGone,
    StageState,
    TraceSink,
    lost_reason,
)
from layerbus.planner.chain import Placement
from layerbus.wire import protocol
from layerbus.wire.curve import ClusterKeys, CurveGate
from layerbus.wire.frames import WireError, encode
from layerbus.wire.spans import LayerRange
from layerbus.wire.weight_formats import WEIGHT_FORMATS

log = logging.getLogger("layerbus.broker")


class ControlPlane:
    def __init__(self, context: zmq.Context, bind: str = "tcp://127.0.0.1:*",
                 clock: Callable[[], float] = time.monotonic, keys: ClusterKeys | None = None,
                 heartbeat_interval_s: float = 0.5):
        self.clock = clock
        self.keys = keys
        # The broker's one ZAP authenticator and handshake monitors (the broker guards its results socket too).
        self.gate = CurveGate(context, keys.keypair, keys.allowed) if keys is not None else None
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted stage may reuse its name
        if self.gate is not None:
            self.gate.guard(socket)
        try:
            socket.bind(bind)  # here, on the caller's thread, so a port in use is the caller's error
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        self.address = socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.stages: dict[bytes, StageInfo] = {}
        self.registered = 0  # stages registered so far (a process again under a known name counts anew)
        self.epoch = 0
        # What the broker is busy with while stages wait ("preparing the model", "planning"); None once it
        # serves. The control thread says it to every registered stage when it changes, and in heartbeats.
        self.phase: str | None = None
        # Set by a tracing broker: assignments then ask for step records, and heartbeats carry the clock.
        self.tracer: TraceSink | None = None
        # Set by a LocalCluster: its stage processes, looked at on every poll; `exits` is what they reported.
        self.children: ChildWatch | None = None
        self.exits: list[StageExit] = []
        # Stages that went GONE (ended, left, or replaced by a new process under their name), for whoever
        # says what was lost (Replanner.check_spares): a spare's StageInfo is held by no chain, and a
        # restart under its name replaces it here before any liveness window could find it silent.
        self.departed: list[StageInfo] = []
        # Refusals not yet in a job's events (the pipeline takes them), and those already logged: a peer
        # that keeps retrying is logged and recorded once.
        self.refusals: list[str] = []
        self._refusals_seen: set[str] = set()
        self._refusals_checked = 0.0
        self.owns_context = False  # open_control made its context for it (a secured broker's own)
        self._closed = False
        # The socket is served on a thread of its own from here on (broker/control_io.py).
        self.io = ControlIO(context, socket, clock, heartbeat_interval_s, self._heartbeat_fields,
                            lambda: self.phase, secured=keys is not None)
        self.io.start()

    @property
    def wake(self) -> zmq.Socket:
        """Readable when control messages wait to be taken (poll them): for the pipeline loop's poller."""
        return self.io.wake

    def _heartbeat_fields(self) -> dict:
        """Called on the control thread: a tracing broker's heartbeats carry its clock, for the offset."""
        tracer = self.tracer
        return {"sent_us": tracer.now_us()} if tracer is not None else {}

    # -- receiving -----------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 0) -> list[ControlEvent]:
        """The events of every control message that arrived (waiting up to `timeout_ms` for one), after
        judging each: who registered, who is ready, failed or gone. The control thread has answered them."""
        if timeout_ms > 0:
            self.io.wake.poll(timeout_ms)
        events = []
        for arrival in self.io.take():
            events.extend(self._handle(arrival))
        if self.children is not None:
            events.extend(self._child_exited(ended) for ended in self.children.check())
        now = self.clock()
        if now - self._refusals_checked >= 1.0:
            self._refusals_checked = now
            self._note_refusals()
        return events

    def _child_exited(self, ended: StageExit) -> ControlEvent:
        """A stage process this broker started has ended: the stage is gone now, not after the liveness
        window, and says why. A later registration under its name (a restart) is a new stage."""
        self.exits.append(ended)
        stage = self.stages.get(ended.name.encode())
        if stage is not None and ended.pid in (stage.pid, 0) and stage.state.alive:  # 0: the launcher knew no pid
            why = ended.why if ended.why.startswith("its ") else f"its process {ended.why}"
            stage.state, stage.loaded, stage.error = StageState.GONE, None, why
            self.departed.append(stage)
        return ControlEvent("bye", ended.name, {"exited": ended.why})

    def _handle(self, arrival: Arrival) -> list[ControlEvent]:
        identity = arrival.identity
        if arrival.message is None:
            log.error("malformed control message from stage %r: %s", identity.decode(errors="replace"), arrival.error)
            return []
        header, kind, now = arrival.message.header, arrival.kind, arrival.at
        from_heartbeat_thread = arrival.from_heartbeat_thread
        if kind == protocol.REGISTER and not from_heartbeat_thread:
            self._register(identity, header, now, arrival.proven_key if self.keys is not None else None)
            return []
        stage = self.stages.get(identity)
        if kind == LINK_TIMED:  # the control thread's timing of a link, not a message of the stage
            return [ControlEvent(kind, stage.name if stage is not None else identity.decode(errors="replace"), header)]
        if stage is None:  # the control thread told it to register (its heartbeats may come first)
            log.debug("control message %r from unregistered stage %r ignored", kind, identity)
            return []
        if stage.state is StageState.LOST:
            # Presumed dead and re-planned without, it speaks again (SIGCONT, a healed network). Its
            # span belongs to an old epoch: tell it to drop it and register again as a spare.
            log.warning("stage %s, presumed lost, is back: told to register again", stage.name)
            stage.state = StageState.RESET
            self.send(stage, protocol.RESET)
            return []
        stage.last_seen = max(stage.last_seen, now)
        if "stats" in header and isinstance(header["stats"], dict):
            stage.stats = header["stats"]
        if isinstance(header.get("busy_s"), (int, float)):
            stage.busy_s = float(header["busy_s"])
        if self.tracer is not None and isinstance(header.get("trace"), dict):  # heartbeats and TRACE answers
            self.tracer.stage_message(stage, header["trace"])
        if from_heartbeat_thread:
            return []
        if kind == protocol.READY and header.get("epoch") == self.epoch:
            stage.state = StageState.READY
            stage.loaded = _loaded_span(header.get("layers"))
            stage.kept = _loaded_span(header.get("kept"))
            outputs_at = header.get("outputs_at")
            stage.outputs_at = outputs_at if isinstance(outputs_at, int) and not isinstance(outputs_at, bool) else None
            # Reported figures only: one a stage got wrong is shown as 0, never allowed to stop the broker.
            stage.param_bytes = int(_figure(header.get("param_bytes")))
            stage.weights = str(header.get("weights", ""))
            stage.load_s = _figure(header.get("load_s"))
            stage.peak_rss = int(_figure(header.get("peak_rss")))
            stage.rss_before_load = int(_figure(header.get("rss_before_load")))
        elif kind == protocol.FAILURE:
            log.error("stage %s reports: %s", stage.name, header.get("error"))
            if not isinstance(header.get("mb"), int):  # not about one step: the stage cannot serve its span
                stage.state, stage.error = StageState.FAILED, str(header.get("error"))
            return [ControlEvent("failure", stage.name, header)]
        elif kind == protocol.REJECTED:
            if header.get("refused") is True:  # its data port refused a handshake
                self._refused(f"stage {stage.name}'s data port {header.get('error')}")
                return []
            log.error("stage %s rejected a message from %s: %s", stage.name, header.get("sender"), header.get("error"))
            return [ControlEvent("rejected", stage.name, header)]
        elif kind == protocol.BYE:
            if stage.state.alive:
                self.departed.append(stage)
            stage.state = StageState.GONE
            return [ControlEvent("bye", stage.name, header)]
        elif kind in (protocol.PROFILE_RESULT, protocol.PROBE_ECHO,  # read by broker.profiling
                      protocol.LINK_PROBE_RESULT, protocol.LINK_ADMITTED):  # and broker.link_probing
            return [ControlEvent(kind, stage.name, header)]
        return []

    def _register(self, identity: bytes, header: dict, now: float, public_key: str | None) -> None:
        try:
            protocol.require_fields(header, "register", {"name": str, "device": str, "dtype": str,
                                                         "threads": int, "data_address": str})
            budget = header.get("memory_budget")
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
                raise WireError(f"register header field 'memory_budget' must be a positive int of bytes or absent, "
                                f"got {budget!r:.60}")
        except WireError as error:
            log.error("registration from %r refused: %s", identity, error)
            return
        known = self.stages.get(identity)
        if (known is not None and known.state.alive and known.pid == int(_figure(header.get("pid")))
                and known.data_address == header["data_address"]):
            # The same process again (it registers anew on every connection, and until the broker first
            # answers): nothing to change, whatever it was told since.
            known.last_seen = max(known.last_seen, now)
            return
        if known is not None and known.state.alive:
            # Another process under its name (a supervisor restarted it faster than the liveness window): the
            # process the chain knew is gone, now, and said so (the chain holds its StageInfo, which says it).
            known.state, known.loaded = StageState.GONE, None
            known.error = f"restarted: a new process (pid {_figure(header.get('pid')):.0f}) registered under its name"
            self.departed.append(known)
        self.registered += 1
        self.stages[identity] = StageInfo(
            identity=identity, name=header["name"], device=header["device"], dtype=header["dtype"],
            threads=header["threads"], memory_budget=header.get("memory_budget"),
            data_address=header["data_address"], public_key=public_key, host=str(header.get("host", "?")),
            pid=int(_figure(header.get("pid"))), last_seen=now, own_weights=_weights_flag(header.get("weights")))
        if any(ended.name == header["name"] and ended.pid == self.stages[identity].pid for ended in self.exits):
            # Registered, then ended before this message was read: it cannot serve.
            self.stages[identity].state = StageState.GONE
        log.info("stage %s registered (%s, %s, %d threads, data at %s)", header["name"], header["device"],
                 header["dtype"], header["threads"], header["data_address"])

    def _note_refusals(self) -> None:
        for refusal in self.gate.refusals() if self.gate is not None else ():
            self._refused(f"the broker {refusal.describe()}")

    def _refused(self, message: str) -> None:
        if message in self._refusals_seen or len(self._refusals_seen) > 1000:
            return
        self._refusals_seen.add(message)
        log.warning("%s", message)
        self.refusals.append(message)

    def take_refusals(self) -> list[str]:
        taken, self.refusals = self.refusals, []
        return taken

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.io.close()
        if self.gate is not None:
            self.gate.close()

    # -- sending -------------------------------------------------------------------------------
    def send(self, stage: StageInfo, kind: str, **fields) -> None:
        self.io.send([stage.identity, *encode(dict(fields, kind=kind))])

    def time_link(self, stage: StageInfo, payload_bytes: int, rounds: int) -> int:
        """Have the control thread time the link to `stage` (echoes without and with `payload_bytes`, `rounds`
        of each); the outcome comes back as a LINK_TIMED event with the token returned."""
        return self.io.time_link(stage.identity, payload_bytes, rounds)

    def live_stages(self) -> list[StageInfo]:
        return [s for s in self.stages.values() if s.state.alive]

    def stage(self, name: str) -> StageInfo:
        """The registered stage of this name (KeyError naming the known ones)."""
        found = self.stages.get(name.encode())
        if found is None:
            found = next((s for s in self.stages.values() if s.name == name), None)
        if found is None:
            raise KeyError(f"no stage {name!r} registered; registered: {sorted(s.name for s in self.stages.values())}")
        return found

    def mark_lost(self, stage: StageInfo) -> None:
        """Serve no more steps through this stage; if it speaks again it is told to re-register."""
        stage.state, stage.loaded = StageState.LOST, None

    def check_stages(self, stages: list[StageInfo], window_s: float, stuck_s: float) -> None:
        """Raise StageLost for the first of `stages` that `lost_reason` finds lost."""
        now = self.clock()
        for stage in stages:
            reason = lost_reason(stage, now, window_s, stuck_s)
            if reason is not None:
                raise StageLost(stage, reason)

    def redirect(self, stage: StageInfo, endpoint: str, release: bool = False) -> None:
        """Send `stage` on to the broker at `endpoint` (`layerbus broker --chains auto`, once its stages are
        profiled and grouped) and forget it: it is that broker's now, and hears nothing more from this one,
        not even the shutdown at close. `release`: the stage drops the span it holds first."""
        self.send(stage, protocol.REDIRECT, **protocol.redirect_header(endpoint, release=release))
        self.io.forget(stage.identity)
        del self.stages[stage.identity]

    def release_all(self, endpoint: str) -> list[StageInfo]:
        """Send every live stage, spans dropped, to the broker at `endpoint` (a chain that gives up hands its
        survivors back to its front door, launch/broker_chains.py); the stages sent."""
        sent = self.live_stages()
        for stage in sent:
            self.redirect(stage, endpoint, release=True)
        return sent

    def shutdown_all(self) -> None:
        for stage in self.live_stages():
            self.send(stage, protocol.SHUTDOWN)

    # -- orchestration -------------------------------------------------------------------------
    def wait_for_stages(self, count: int, timeout_s: float) -> list[StageInfo]:
        """The first `count` live stages once they have registered, less those `children` gave up on (their
        process ended for good). The ones that registered hear heartbeats meanwhile (the control thread)."""
        deadline = self.clock() + timeout_s
        while True:
            expected = count - len(self.children.given_up) if self.children is not None else count
            live = self.live_stages()
            if expected < 1:
                raise StagesGone(f"none of the {count} stages can serve: {self.stages_missing()}")
            if len(live) >= expected:
                return live[:expected]
            if self.clock() > deadline:
                missing = self.stages_missing()
                raise ClusterError(f"{len(live)} of {expected} stages registered and alive after {timeout_s:.0f} s "
                                   f"at {self.address}{'; ' + missing if missing else ''}; start more with "
                                   f"`layerbus stage --broker {self.address}`")
            self.poll(100)

    def none_can_come_back(self) -> bool:
        """Every watched stage process has ended for good, and no stage is registered and alive."""
        children = self.children
        return (children is not None and children.watched > 0 and len(children.given_up) >= children.watched
                and not self.live_stages())

    def stages_missing(self) -> str:
        """The stages that registered and left, and the stage processes that ended, each with why."""
        gone = [f"{s.name} registered, then {s.error or s.state.value}" for s in self.stages.values()
                if not s.state.alive]
        ended = [f"{e.name} (pid {e.pid}) {e.why}" for e in self.exits
                 if e.name.encode() not in self.stages or self.stages[e.name.encode()].pid != e.pid]
        return "; ".join(gone + ended)

    def assign(self, placement: Placement, model_dir: str, result_address: str, num_slots: int,
               max_context: int, timeout_s: float, liveness_window_s: float | None = None,
               weights: str | Sequence[str] = "auto", keep_caches: bool = True,
               context_hint: int = 0) -> list[StageInfo]:
        """Give each stage of `placement` its span, next hop, the codec of that hop (float32 where
        the placement has none) and the weight format (one for all, or one per stage of the chain; a
        stage started with its own --weights keeps that) and whether to keep caches across a re-plan
        (BatchingConfig.keep_caches); wait until all report READY. A stage whose load fails raises ClusterError naming it.
        `context_hint` (> 0): the positions the job's longest sequence can reach, for the stages to size
        their KV caches once at load (a cache grown mid-job stalls every stage behind it while it copies).

        With `liveness_window_s`, a stage that dies while loading raises StageLost (its heartbeats
        continue during a load, so a long load is not mistaken for a death). Returns the chain's stages, as
        they registered: the processes that loaded it."""
        self.epoch += 1
        chain = [self.stage(name) for name in placement.stages]
        formats = [weights] * len(chain) if isinstance(weights, str) else list(weights)
        for i, (stage, span) in enumerate(zip(chain, placement.spans)):
            next_address = chain[i + 1].data_address if i + 1 < len(chain) else result_address
            stage.state, stage.loaded, stage.error = StageState.LOADING, None, None
            stage.kept, stage.outputs_at = None, None
            link_codec = placement.codecs[i] if i < len(placement.codecs) else "float32"
            traced = {"trace": True} if self.tracer is not None else {}
            hinted = {"context_hint": context_hint} if context_hint > 0 else {}
            self.send(stage, protocol.ASSIGN, epoch=self.epoch, model_dir=model_dir, layers=span.to_json(),
                      is_first=i == 0, is_last=i == len(chain) - 1, next_address=next_address,
                      num_slots=num_slots, max_context=max_context, wire=link_codec, weights=formats[i],
                      keep_caches=keep_caches,
                      **self._link_keys(chain, i), **traced, **hinted)
        deadline = self.clock() + timeout_s
        # Take in what arrived while the broker was busy (planning a large job takes seconds): each
        # message counts from when it arrived, so no stage looks silent for the broker's own delay.
        self.poll(0)
        while True:  # a failed load is checked first: it is a ClusterError (re-plan without it), not a loss
            failed = [(stage, span) for stage, span in zip(chain, placement.spans) if stage.state is StageState.FAILED]
            if failed:
                raise ClusterError("; ".join(f"stage {s.name} could not load layers {span}: {s.error}"
                                             for s, span in failed))
            if all(stage.state is StageState.READY for stage in chain):
                return chain
            if self.clock() > deadline:
                waiting = [s.name for s in chain if s.state is not StageState.READY]
                raise ClusterError(f"stages {waiting} did not finish loading within {timeout_s:.0f} s")
            if liveness_window_s is not None:
                self.check_stages(chain, liveness_window_s, stuck_s=timeout_s)
            self.poll(100)

    def _link_keys(self, chain: list[StageInfo], i: int) -> dict:
        """For a secured cluster: the server key of the hop stage i sends to (the next stage's, or the
        broker's results socket), and the one client key its data port admits (the hop before it)."""
        if self.keys is None:
            return {}
        own = self.keys.keypair.public.decode()
        return {"next_key": chain[i + 1].public_key if i + 1 < len(chain) else own,
                "prev_key": chain[i - 1].public_key if i > 0 else own}


def _weights_flag(value: object) -> str | None:
    """A stage's own --weights from its REGISTER (None: absent, or a name this broker does not know)."""
    return value if isinstance(value, str) and value in WEIGHT_FORMATS else None


def _figure(value: object) -> float:
    """A number a stage reported, or 0 for anything that is not a finite non-negative number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)


def _loaded_span(value: object) -> LayerRange | None:
    try:
        return LayerRange.from_json(value)
    except ValueError:
        return None
