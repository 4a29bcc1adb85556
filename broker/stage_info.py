"""What the broker knows of each stage, and the one place a stage of a chain is judged lost.

`StageInfo` is a registered stage as the control plane keeps it (broker/control.py): what it is, where it
is in its life (`StageState`), what it last reported. `lost_reason` decides whether it can serve no more;
`StageLost` and the other ClusterErrors carry that decision to whoever re-plans."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from layerbus.wire.spans import LayerRange


class ClusterError(RuntimeError):
    """The stages cannot serve: too few registered, a load failed, a stage went silent."""


class StagesGone(ClusterError):
    """Every stage process this broker was told of has ended, and none can come back (none is restarted):
    waiting would be for ever. The job is left as it is, for a later run."""


class StageLost(ClusterError):
    """A stage stopped serving (silent past the liveness window, stuck, or gone): re-plan without it."""

    def __init__(self, stage: "StageInfo", reason: str):
        super().__init__(f"stage {stage.name} ({stage.host} pid {stage.pid}) lost: {reason}")
        self.stage, self.reason = stage, reason


class StageState(Enum):
    """Where a registered stage is in its life, as the broker sees it."""

    SPARE = "spare"  # registered, holds no span: may be given one by the next plan
    LOADING = "loading"  # told its span, not READY yet
    READY = "ready"  # loaded its span for the current epoch: serving
    FAILED = "failed"  # reported an error that is not about one step (a load failure, its loop died)
    GONE = "gone"  # said goodbye (stopped or shut down)
    LOST = "lost"  # declared lost by the broker (silent, stuck, gone or failed while in the chain)
    RESET = "reset"  # lost, then spoke again: told to drop its span and register again

    @property
    def alive(self) -> bool:
        """Still a member of the cluster (may serve, or be planned over once more)."""
        return self not in (StageState.GONE, StageState.LOST, StageState.RESET)


@dataclass
class StageInfo:
    """What the broker knows about one registered stage."""

    identity: bytes  # ROUTER identity (the stage's name)
    name: str
    device: str
    dtype: str
    threads: int
    memory_budget: int | None
    data_address: str  # where the stage receives steps
    host: str
    pid: int
    last_seen: float  # broker clock when anything last arrived from it
    state: StageState = StageState.SPARE
    loaded: LayerRange | None = None  # the span it said it loaded in its last READY (its own report)
    # Of its last READY: the layers whose caches it carried from its previous span, and the layer the
    # hidden states it kept enter (broker.replay_window); None: nothing carried.
    kept: LayerRange | None = None
    outputs_at: int | None = None
    param_bytes: int = 0  # bytes of the weights it holds (packed blocks counted as held)
    weights: str = ""  # the weight format it reported loading in READY ("fp32", "int4 (q4_1 g32)", ...)
    own_weights: str | None = None  # its own --weights when it registered (None: it takes the broker's)
    load_s: float = 0.0
    peak_rss: int = 0  # the stage's peak resident memory when it reported READY
    rss_before_load: int = 0  # its resident memory before loading the span
    stats: dict = field(default_factory=dict)
    error: str | None = None
    busy_s: float = 0.0  # how long its current step or load had run at its last heartbeat
    public_key: str | None = None  # its CURVE key (Z85) as its connection proved it; None: an unsecured cluster


@dataclass(frozen=True)
class ControlEvent:
    """Something the pipeline loop must act on."""

    kind: str  # failure, rejected, bye, profile_result, probe_echo
    stage: str
    header: dict


@dataclass(frozen=True)
class StageExit:
    """A local stage process that ended, and what became of it."""

    name: str  # the stage's --name (stage-i)
    pid: int  # the process that ended
    why: str  # how it ended and the last lines of its log, in words
    restarted: bool  # a new process of the same name was started in its place
    restarts: int  # restarts of this stage so far, this one included


class TraceSink(Protocol):
    """Where step records from the stages go when the broker traces (broker.trace_file.BrokerTrace)."""

    def now_us(self) -> int: ...

    def stage_message(self, stage: StageInfo, payload: dict) -> None: ...


class ChildWatch(Protocol):
    """The stage processes this broker started (launch.stage_supervisor.StageSupervisor)."""

    given_up: set[str]  # names of stages that ended and will not come back
    max_restarts: int  # restarts of each stage allowed while the cluster starts
    watched: int  # the stage processes it watches: all of them in given_up, none can come back

    def check(self) -> list[StageExit]: ...


def lost_reason(stage: StageInfo, now: float, window_s: float, stuck_s: float) -> str | None:
    """Why this stage of a chain can serve no more (None: it can): it left, it reported an error that
    is not about one step, it has been silent past `window_s`, or one step or load has run past
    `stuck_s` (its heartbeats go on, its main loop does not). The one place "stage gone" is decided."""
    if stage.state is StageState.GONE:
        return stage.error or "it left (stopped or shut down)"
    if stage.state is StageState.FAILED:
        return f"it reported: {stage.error}"
    silent = now - stage.last_seen
    if silent > window_s:
        return f"silent for {silent:.1f} s (liveness window {window_s:g} s)"
    if stage.busy_s > stuck_s:
        return f"stuck in one step or load for {stage.busy_s:.0f} s (limit {stuck_s:g} s)"
    return None
