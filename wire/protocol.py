"""Message kinds and their fields, for both planes.

Data plane (PUSH/PULL, broker -> stage 0 -> ... -> last stage -> broker):
  step    header {mb, step, attempt, epoch, rows: [[slot, start, length, emit, sampling|{}], ...],
          release: [slot, ...]} + tensor "tokens" [N] int64 (to stage 0), or (later stages) hidden
          states [N, H] in the sender's link codec: header codec {name, shape: [N, H]} and tensors
          "hidden" (float codecs) or "hidden.q", "hidden.scale", "hidden.outlier_index",
          "hidden.outlier_value" (int8, int4); see wire/codecs.py
          prefix? {restore: [[slot, entry, length], ...], save: [[slot, entry, length], ...],
          drop: [entry, ...]} (the stages' prefix cache, broker/prefix_cache.py: before computing,
          copy an entry's first `length` positions into the slot, whose row then starts there; after
          computing, copy the slot's first `length` positions into a new entry; free dropped entries)
  result  header {mb, step, attempt, epoch, tokens: [[slot, token, logprob], ...],
          scores: [[slot, [logprob of each target], [target is the argmax: bool each]], ...]}
          (last stage -> broker)

Control plane (DEALER at each stage, ROUTER at the broker), headers only:
  stage -> broker: register {name, device, dtype, weights (its own --weights, or null), threads,
                   memory_budget, data_address, pid, host, left_chain? (true once, the first
                   registration after a redirect with release: its chain gave up, so the front door
                   sends it to another)}
                   ready {epoch, layers, param_bytes (weights held, blocks included), weights (the format
                   loaded, e.g. "int4 (q4_1 g32)"), load_s, peak_rss}
                   heartbeat {stats, busy_s, epoch} (from the stage's heartbeat socket, identity
                   + "\0heartbeat")     failure {error, epoch, step?, mb?, attempt?, cause: step|send}
                   rejected {sender, error, refused?} (a malformed data message was dropped; with
                   refused: true, a peer refused in the data port's handshake)   bye {}
                   profile_result {layer_decode_s, layer_prefill_s, embed_s, head_s, step_overhead_s,
                   memory_budget, micro_batch_size, prefill_tokens, cached} or {error}
                   probe_echo {seq}
                   link_admitted {} (the answer to link_admit)
                   link_probe_result {links: [{peer, round_trip_s, bytes_per_s, bursts, burst_s} or
                   {peer, error}, ...]} or {error}
                   trace {trace: {sent_us, down_min_us, dropped, chunk?, records?, final, chunks}, stats}
                   (the answer to trace_flush)
  broker -> stage: assign {epoch, model_dir, layers, is_first, is_last, next_address, num_slots,
                   max_context, wire (codec of the outgoing hidden states; default float32),
                   weights (wire/weight_formats.py; default auto; a stage's own --weights wins),
                   trace? (true: record step spans, see wire/trace_events.py),
                   context_hint? (positions the job's longest sequence can reach: the KV cache is
                   made that long at once, instead of doubling mid-job; 0 or absent: grown as needed),
                   next_key, prev_key (secured clusters: the Z85 CURVE key of the hop it sends to,
                   and the one client key its data port admits; see wire/curve.py)}
                   heartbeat {sent_us?, phase?}     shutdown {}
                   wait {phase, next_s} (the answer to register while the broker is busy: what it is
                   doing, such as "preparing the model" or "planning", and within how many seconds it
                   speaks again; sent again whenever the phase changes; heartbeats carry the phase too)
                   reset {why?} (you were presumed dead, or this broker does not know you (it started
                   after you registered with another on its address): drop your span and register again)
                   redirect {port, endpoint} (from the front door of `layerbus broker --chains K`, in
                   answer to register: register with this chain's broker instead; the stage keeps the
                   host it reached the front door at and takes `port`, or takes `endpoint` where its
                   broker address has no tcp port; release: true, from a chain's broker that gives
                   up: drop the span held, then go register at the front door)
                   profile {model_dir, micro_batch_size, kv_length, prefill_tokens}
                   probe {seq} + tensor "payload" (link probe: echoed at once)
                   link_admit {keys} (secured: the data port admits these stage keys too, until the next
                   assign, so that they can probe it)
                   link_probe {peers: [{name, address, key?}], step_bytes, rows, echoes, burst_s,
                   connect_timeout_s} (time the link to each peer: stages/peer_links.py)
                   trace_flush {id} (ship every step record left, then say so with `final: id`)

Link probes (wire/link_probe.py's netprobe_* kinds) travel on the data plane between stages: a stage
answers them on its data port and never takes them for steps.

Tracing (`--trace`) adds only optional fields and the trace/trace_flush pair: a stage that traces puts
`trace: {sent_us, down_min_us, dropped, chunk?, records?}` in its heartbeats, and the broker's
heartbeats carry `sent_us` (both for the clock offset estimate, stages/tracing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layerbus.wire.frames import WireError

# Control-plane kinds.
REGISTER, ASSIGN, READY, HEARTBEAT, FAILURE, REJECTED, SHUTDOWN, BYE, RESET = (
    "register", "assign", "ready", "heartbeat", "failure", "rejected", "shutdown", "bye", "reset")
# The broker is busy (preparing the model, planning, ...): stay, it speaks again within next_s.
WAIT = "wait"
# Several chains behind one address (`layerbus broker --chains K`): go register with this chain's broker.
REDIRECT = "redirect"
# Placement: the broker asks each stage to measure itself, and times its link with echoed probes.
PROFILE, PROFILE_RESULT, PROBE, PROBE_ECHO = "profile", "profile_result", "probe", "probe_echo"
# The link matrix: the broker has each stage time its links to the others (stages/peer_links.py).
LINK_ADMIT, LINK_ADMITTED, LINK_PROBE, LINK_PROBE_RESULT = (
    "link_admit", "link_admitted", "link_probe", "link_probe_result")
# Tracing: the broker asks for the step records a stage has not shipped yet; they come back as TRACE.
TRACE_FLUSH, TRACE = "trace_flush", "trace"
# Data-plane kinds.
STEP, RESULT = "step", "result"

# Appended to a stage's control identity by its heartbeat socket: the broker counts this socket's
# traffic as the stage's.
HEARTBEAT_IDENTITY_SUFFIX = b"\x00heartbeat"


def redirect_header(endpoint: str, release: bool = False) -> dict:
    """A redirect's fields for a chain's broker bound at `endpoint` (e.g. tcp://0.0.0.0:5557): its port,
    which the stage joins to the host it reached the front door at (a wildcard bind names no host a
    stage could use), and the endpoint itself for binds without a port (ipc://). `release`: the stage
    drops the span it holds first (a chain that gave up sends its survivors back to the front door, which
    sends them on to a chain still working); without it a stage holding a span ignores the redirect."""
    port = _tcp_port(endpoint)
    fields = {"port": port, "endpoint": endpoint} if port is not None else {"endpoint": endpoint}
    return dict(fields, release=True) if release else fields


def redirected_endpoint(current: str, header: dict) -> str:
    """Where a stage that reached the front door at `current` registers next, from a redirect's fields."""
    port, endpoint = header.get("port"), header.get("endpoint")
    if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 and _tcp_port(current) is not None:
        return f"{current.rsplit(':', 1)[0]}:{port}"
    if isinstance(endpoint, str) and endpoint:
        return endpoint
    raise WireError(f"redirect without a usable port or endpoint: {header!r}")


def _tcp_port(endpoint: str) -> int | None:
    if not endpoint.startswith("tcp://"):
        return None
    _, _, port = endpoint.rpartition(":")
    return int(port) if port.isdigit() else None


@dataclass(frozen=True)
class StepRow:
    """One sequence's part of a step, as the broker sent it."""

    slot: int  # the sequence's slot (its KV cache place on every stage)
    start: int  # position of the first new token
    length: int  # new tokens in this step
    emit: bool = False  # the last stage returns the next token after this row's last position
    sampling: dict = field(default_factory=dict)  # temperature, top_k, top_p, seed (empty = greedy)
    targets: list[int] | None = None  # log-probs of these next tokens at the row's first positions


def rows_to_json(rows: list[StepRow]) -> list[list[Any]]:
    """Compact row encoding: decode headers stay small even with dozens of rows."""
    encoded = []
    for row in rows:
        item: list[Any] = [row.slot, row.start, row.length, int(row.emit), row.sampling]
        if row.targets is not None:
            item.append(row.targets)
        encoded.append(item)
    return encoded


def rows_from_json(value: Any) -> list[StepRow]:
    if not isinstance(value, list):
        raise WireError("step header 'rows' must be a list")
    rows = []
    for item in value:
        if not isinstance(item, list) or len(item) not in (5, 6):
            raise WireError(f"step row must be [slot, start, length, emit, sampling(, targets)], got {item!r:.80}")
        slot, start, length, emit, sampling = item[:5]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (slot, start, length, emit)):
            raise WireError(f"step row fields must be integers, got {item!r:.80}")
        if slot < 0 or start < 0 or length < 1:
            raise WireError(f"step row needs slot >= 0, start >= 0, length >= 1, got {item!r:.80}")
        if not isinstance(sampling, dict):
            raise WireError(f"step row sampling must be an object, got {sampling!r:.80}")
        targets = item[5] if len(item) == 6 else None
        # Targets score the row's first len(targets) positions: a prompt's last position predicts a
        # token nobody knows yet, so the final chunk of a scored prompt carries one target fewer.
        if targets is not None and (not isinstance(targets, list) or len(targets) > length
                                    or not all(type(t) is int and t >= 0 for t in targets)):
            raise WireError(f"step row targets must be at most {length} token ids, got {targets!r:.80}")
        rows.append(StepRow(slot, start, length, bool(emit), sampling, targets))
    return rows


@dataclass(frozen=True)
class PrefixOps:
    """A step's prefix-cache work (broker/prefix_cache.py), each copy as (slot, entry, length)."""

    restore: list[tuple[int, int, int]] = field(default_factory=list)
    save: list[tuple[int, int, int]] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)


def prefix_ops_to_json(restore: list[tuple[int, int, int]], save: list[tuple[int, int, int]],
                       drop: list[int]) -> dict[str, Any]:
    """The step header's `prefix` field: only what the step does ({} when nothing)."""
    ops: dict[str, Any] = {}
    if restore:
        ops["restore"] = [list(op) for op in restore]
    if save:
        ops["save"] = [list(op) for op in save]
    if drop:
        ops["drop"] = list(drop)
    return ops


def window_from_json(value: Any) -> tuple[int, int] | None:
    """A replay step's layer window [w0, w1) (broker.replay_window), None when the step has none."""
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value) or not 0 <= value[0] < value[1]):
        raise WireError(f"'window' must be [first layer, end layer] with 0 <= first < end, got {value!r:.60}")
    return value[0], value[1]


def prefix_ops_from_json(value: Any, rows: list[StepRow]) -> PrefixOps:
    """A step's `prefix` field, checked against its rows: a restore fills exactly the positions before its
    row's start, and a save copies only positions the slot holds once the step ran."""
    if value is None:
        return PrefixOps()
    if not isinstance(value, dict) or set(value) - {"restore", "save", "drop"}:
        raise WireError(f"step header 'prefix' must be an object of restore, save and drop, got {value!r:.80}")
    row_of = {row.slot: row for row in rows}
    copies: dict[str, list[tuple[int, int, int]]] = {}
    for kind in ("restore", "save"):
        ops = value.get(kind, [])
        if not isinstance(ops, list):
            raise WireError(f"prefix {kind} must be a list, got {ops!r:.80}")
        copies[kind] = []
        for op in ops:
            if (not isinstance(op, list) or len(op) != 3
                    or not all(type(v) is int and v >= 0 for v in op) or op[2] < 1):
                raise WireError(f"prefix {kind} must be [slot, entry, length >= 1], got {op!r:.80}")
            row = row_of.get(op[0])
            if row is None:
                raise WireError(f"prefix {kind} names slot {op[0]}, which has no row in this step")
            if kind == "restore" and op[2] != row.start:
                raise WireError(f"prefix restore of {op[2]} positions into slot {op[0]}, whose row starts at "
                                f"{row.start}")
            if kind == "save" and op[2] > row.start + row.length:
                raise WireError(f"prefix save of {op[2]} positions from slot {op[0]}, which holds "
                                f"{row.start + row.length} after this step")
            copies[kind].append((op[0], op[1], op[2]))
    drop = value.get("drop", [])
    if not isinstance(drop, list) or not all(type(v) is int and v >= 0 for v in drop):
        raise WireError(f"prefix drop must be a list of entry ids, got {drop!r:.80}")
    return PrefixOps(copies["restore"], copies["save"], list(drop))


def require_fields(header: dict[str, Any], kind: str, fields: dict[str, type]) -> None:
    """Reject a header missing a field or carrying one of the wrong type, naming both."""
    for name, expected in fields.items():
        value = header.get(name)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise WireError(f"{kind} header field {name!r} must be {expected.__name__}, got {value!r:.60}")


def require_endpoint(value: str, field: str) -> str:
    """An address a stage is told to connect to, checked for form now (the stage connects at its first send,
    when a bad one could no longer fail the assignment): tcp://HOST:PORT, ipc://PATH or inproc://NAME."""
    scheme, _, rest = value.partition("://")
    host, _, port = rest.rpartition(":")
    if not ((scheme in ("ipc", "inproc") and rest) or (scheme == "tcp" and host and port.isdigit())):
        raise WireError(f"{field} {value!r:.80} is not a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH, inproc://NAME)")
    return value
