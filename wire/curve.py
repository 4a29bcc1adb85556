"""CurveZMQ keys and sockets: who may join a cluster, and links nobody else can read or write.

libzmq's CURVE mechanism (elliptic-curve keys, an authenticated and encrypted handshake, every
frame encrypted after it) and pyzmq's ZAP authenticator (`zmq.auth`) do the work; nothing here is
a handshake of our own. The roles, as ZeroMQ wants them:

- the side that binds (the broker's control and results sockets, a stage's data port) is the
  CURVE *server*: it holds its own keypair and an authenticator that admits only the public keys
  in an allowed folder (`start_authenticator`);
- the side that connects is the *client*: its own keypair plus the server's public key, which it
  must know beforehand (the broker's from a file, the next stage's from the broker).

Keys are ZeroMQ's certificate files (`zmq.auth.create_certificates`): NAME.key holds the public key,
NAME.key_secret both; the secret file is readable by its owner only.

In a cluster (docs/operations.md, "Security and keys"): the broker's control ROUTER and results PULL are servers with the
broker's keypair, admitting the allowed stage keys and the broker's own (local stages share it); each
stage's data PULL is a server with the stage's keypair, admitting only the hop before it, whose key
the broker names in the stage's assignment (the broker's for the first stage). Every PUSH and DEALER
is a client that knows its server's key: the broker's from --broker-key, a stage's from the
assignment, where the broker puts the key that stage's own handshake proved at registration.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import stat
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"


class CurveKeyError(ValueError):
    """A key file or folder that cannot be used; the message says which and what to do."""


@dataclass(frozen=True)
class Keypair:
    """A CURVE keypair, Z85-encoded as ZeroMQ's socket options take them."""

    public: bytes
    secret: bytes = field(repr=False)  # never in a log line or a config's repr
    path: Path = Path()  # the secret file it came from (for messages)


@dataclass(frozen=True)
class ClusterKeys:
    """The broker's keys: its keypair and the stage keys it admits. Its own public key is always
    admitted: the stages a broker starts itself (`layerbus run`, run_cluster.sh's local stages) share its
    keypair, being its processes, on its machine, of its user."""

    keypair: Keypair
    allowed: frozenset[bytes] = frozenset()  # stage public keys (Z85), the broker's own added

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", frozenset(self.allowed) | {self.keypair.public})


@dataclass(frozen=True)
class StageKeys:
    """A stage's keys: its keypair (its control and result links, and its data port's server key) and the
    broker's public key."""

    keypair: Keypair
    broker: bytes  # Z85


def make_keypair(folder: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (secret, mode 0600) into `folder`; refuses to
    replace an existing key, since a lost secret key locks its owner out of the cluster."""
    if not name or "/" in name or name.startswith("."):
        raise CurveKeyError(f"key name {name!r} must be a plain file name such as 'broker' or 'gpu-box-1'")
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}{PUBLIC_SUFFIX}", folder / f"{name}{SECRET_SUFFIX}"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing:
        raise CurveKeyError(f"{', '.join(existing)} already exist(s); keys are never overwritten: choose another "
                        "--name, or delete the old pair first if you mean to replace it")
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        made_public, made_secret = zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old_umask)
    os.chmod(made_secret, 0o600)
    os.chmod(made_public, 0o644)
    return Path(made_public), Path(made_secret)


def read_keypair(path: Path) -> Keypair:
    """The keypair in a NAME.key_secret file, or in the one *.key_secret file of a folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        secrets = sorted(path.glob(f"*{SECRET_SUFFIX}"))
        if len(secrets) != 1:
            found = ", ".join(p.name for p in secrets) or "none"
            raise CurveKeyError(f"{path} must hold exactly one *{SECRET_SUFFIX} file (found: {found}); make one with "
                            f"`layerbus keys new {path} --name NAME`, or pass the file itself")
        path = secrets[0]
    if not path.is_file():
        raise CurveKeyError(f"no key file {path}; make a keypair with `layerbus keys new DIR --name NAME`")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveKeyError(f"{path} is readable by others (mode {stat.filemode(mode)}); a secret key must be the "
                        f"owner's alone: chmod 600 {path}")
    public, secret = _load(path)
    if secret is None:
        raise CurveKeyError(f"{path} holds no secret key (a public .key file?); pass the {SECRET_SUFFIX} file")
    return Keypair(public, secret, path)


def read_public_key(path: Path) -> bytes:
    """The public key in a NAME.key (or NAME.key_secret) file, or in the one *.key file of a folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        publics = sorted(path.glob(f"*{PUBLIC_SUFFIX}"))
        if len(publics) != 1:
            found = ", ".join(p.name for p in publics) or "none"
            raise CurveKeyError(f"{path} must hold exactly one *{PUBLIC_SUFFIX} file (found: {found}); pass the file")
        path = publics[0]
    if not path.is_file():
        raise CurveKeyError(f"no public key file {path}; copy the peer's NAME{PUBLIC_SUFFIX} here")
    public, _ = _load(path)
    return public


def allowed_keys(folder: Path) -> list[bytes]:
    """The public keys in `folder`'s *.key files: the peers a server admits."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CurveKeyError(f"allowed-keys folder {folder} does not exist; copy each stage's NAME{PUBLIC_SUFFIX} into it")
    keys = [read_public_key(p) for p in sorted(folder.glob(f"*{PUBLIC_SUFFIX}"))]
    if not keys:
        raise CurveKeyError(f"{folder} holds no *{PUBLIC_SUFFIX} files: no stage could ever join; copy each stage's "
                        f"public key file into it")
    return keys


def start_authenticator(context: zmq.Context, allowed) -> "RecordingAuthenticator":
    """A ZAP authenticator on `context` (a thread, as pyzmq provides it) that admits CURVE clients
    whose public key is in `allowed` and refuses every other, noting each refusal; `.stop()` it when
    done. One per context: libzmq asks the context's one ZAP handler about every server socket."""
    authenticator = RecordingAuthenticator(context, allowed)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=authenticator)
    return authenticator


def secure_server(socket: zmq.Socket, keypair: Keypair) -> None:
    """Make `socket` (before it binds) a CURVE server with this keypair."""
    socket.curve_secretkey = keypair.secret
    socket.curve_publickey = keypair.public
    socket.curve_server = True


def secure_client(socket: zmq.Socket, keypair: Keypair, server_public: bytes) -> None:
    """Make `socket` (before it connects) a CURVE client of the server with `server_public`."""
    socket.curve_secretkey = keypair.secret
    socket.curve_publickey = keypair.public
    socket.curve_serverkey = server_public


# -- refusals ----------------------------------------------------------------------------------
# A handshake that fails before ZAP is asked: a peer with no key (the mechanisms differ), or one that
# does not know our public key (the first message does not decrypt); or one that broke off (both sides of
# a key mismatch hang up at once, so either may see only a closed pipe). libzmq does not say its address.
_NO_ZAP_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_monitor_names = itertools.count()


@dataclass(frozen=True)
class Refusal:
    """A peer refused in the CURVE handshake."""

    reason: str
    address: str = ""  # the peer's IP address where libzmq says it (a refused key); "" where it does not
    key: str = ""  # the peer's public key (Z85) where it offered one we refused

    def describe(self) -> str:
        peer = f"from {self.address}" if self.address else "(libzmq does not say from where)"
        key = f" with key {self.key}" if self.key else ""
        return f"refused a connection {peer}{key}: {self.reason}"


class RecordingAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP authenticator, admitting the CURVE keys in `allowed` and noting who it refused."""

    def __init__(self, context: zmq.Context, allowed):
        super().__init__(context)
        self.allowed = frozenset(bytes(key) for key in allowed)  # replaced whole (CurveGate.admit), never changed
        self._peer = ""  # the address of the request being answered (requests are answered one at a time)
        self._refused: deque[Refusal] = deque(maxlen=1000)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # ZAP request frames: version, request id, domain, address, identity, mechanism, credentials...
        self._peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    def callback(self, domain: str, z85_key: bytes) -> bool:  # pyzmq's credentials-provider interface
        if bytes(z85_key) in self.allowed:
            return True
        self._refused.append(Refusal("its key is not allowed", self._peer, bytes(z85_key).decode("ascii", "replace")))
        return False

    def take_refused(self) -> list[Refusal]:
        taken = []
        while self._refused:  # deque appends and pops are atomic: the ZAP thread may append meanwhile
            taken.append(self._refused.popleft())
        return taken


def _failure_reason(event: dict) -> str:
    if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "the peer has no CURVE key (plain ZeroMQ)"
    if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "the peer's handshake does not decrypt (it does not have this side's public key)"
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return f"the handshake broke off before the peer offered a key ({os.strerror(int(event['value']))})"
    return f"the handshake failed ({zmq.Event(event['event']).name}, {int(event['value'])})"


class CurveGate:
    """The server side of one process: its keypair on every socket it binds, one ZAP authenticator
    admitting `allowed`, and monitors that catch the handshakes ZAP never sees. `refusals()` drains what
    both refused, with the peer's address where libzmq gives it."""

    def __init__(self, context: zmq.Context, keypair: Keypair, allowed=()):
        self.context, self.keypair = context, keypair
        self.authenticator = start_authenticator(context, allowed)
        self.monitors: list[tuple[zmq.Socket, zmq.Socket]] = []

    def guard(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it binds) a CURVE server of this gate, watched for failed handshakes."""
        secure_server(socket, self.keypair)
        address = f"inproc://layerbus-gate-{os.getpid()}-{next(_monitor_names)}"
        socket.monitor(address, _NO_ZAP_FAILURES)
        monitor = self.context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        self.monitors.append((socket, monitor))

    def admit(self, keys) -> None:
        """Admit exactly these client keys (Z85) from now on; connections already made stay."""
        self.authenticator.allowed = frozenset(bytes(key) for key in keys)

    def refusals(self) -> list[Refusal]:
        found = self.authenticator.take_refused()
        for _, monitor in self.monitors:
            while monitor.poll(0):
                found.append(Refusal(_failure_reason(recv_monitor_message(monitor))))
        return found

    def close(self) -> None:
        """Stop watching and stop the authenticator (before the context is terminated)."""
        for socket, monitor in self.monitors:
            if not socket.closed:
                socket.disable_monitor()
            monitor.close(linger=0)
        self.monitors = []
        self.authenticator.stop()


def watch_handshakes(socket: zmq.Socket) -> zmq.Socket:
    """A monitor on a client socket (before it connects) that hears of every handshake: a client refused by
    its server, or one that cannot agree with it, should say so and stop; one that completes a handshake
    (its first connection, or again after the server restarted) may have to introduce itself again."""
    address = f"inproc://layerbus-client-{os.getpid()}-{next(_monitor_names)}"
    socket.monitor(address, _NO_ZAP_FAILURES | zmq.EVENT_HANDSHAKE_FAILED_AUTH | _LINK_EVENTS)
    monitor = socket.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(address)
    return monitor


_LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


@dataclass(frozen=True)
class Handshakes:
    """What a watched client's monitor reported since it was last read."""

    connected: bool | None  # linked after the last event (a handshake completed), unlinked, or None: no news
    succeeded: int  # handshakes completed (connections made, or made again)
    failure: tuple[str, bool] | None  # why one failed, and whether for good (see handshake_events)


def handshake_events(monitor: zmq.Socket, settle_s: float = 0.2) -> Handshakes:
    """Read the watched client's handshakes. A failure is for good when the server refused our key, or one
    side has no keys (libzmq never retries either); otherwise (a wrong server key, or a connection broken
    mid-handshake, as by a broker restarting) libzmq retries. A failure may come as a vague event first (a
    closed pipe) and the telling one just after: after a failure, more are waited for briefly."""
    events = []
    while monitor.poll(0 if not any(not e["event"] & _LINK_EVENTS for e in events) else int(settle_s * 1000)):
        events.append(recv_monitor_message(monitor))
    succeeded = sum(event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED for event in events)
    links = [event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED for event in events if event["event"] & _LINK_EVENTS]
    connected = links[-1] if links else None
    failures = [event for event in events if not event["event"] & _LINK_EVENTS]
    if not failures:
        return Handshakes(connected, succeeded, None)
    if any(event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH for event in failures):
        why = ("the server refused this side's key (it is not in the server's allowed keys)", True)
    elif any(event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH for event in failures):
        why = ("one side has CURVE keys and the other has none", True)
    else:
        why = ("the handshake did not complete (is the server's public key the right one?); retrying", False)
    return Handshakes(connected, succeeded, why)


# -- which binds need keys ---------------------------------------------------------------------
def is_loopback(endpoint: str) -> bool:
    """True for an endpoint no other machine can reach: ipc://, inproc://, and tcp:// on 127.0.0.0/8,
    ::1 or localhost. Anything else (0.0.0.0, *, a host name, an interface) may be reachable."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or ":" not in rest:
        return False
    return is_loopback_host(rest.rsplit(":", 1)[0].strip("[]"))


def is_loopback_host(host: str) -> bool:
    """True for a host name or address no other machine can reach: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unsecured_bind_message(endpoints: list[str], key_options: str) -> str:
    """Why a bind reachable from other machines is refused without keys, and the ways out."""
    return (f"refusing to bind {', '.join(endpoints)} without keys: anyone who can reach it could join the "
            f"cluster, read the activations or send steps. Make keys with `layerbus keys new KEYS --name NAME` and "
            f"pass {key_options} (docs/operations.md: Security and keys), bind a loopback address (tcp://127.0.0.1:PORT), or pass "
            f"--insecure on a network you trust")


def insecure_warning(endpoints: list[str]) -> str:
    return (f"WARNING: --insecure: {', '.join(endpoints)} accept(s) anyone who can reach them, unauthenticated and "
            f"unencrypted")


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as error:
        raise CurveKeyError(f"{path} is not a ZeroMQ certificate file ({error}); make keys with "
                        "`layerbus keys new DIR --name NAME`") from None
