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
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"


class CurveKeyError(ValueError):
    """A key file or folder that cannot be used; the message says which and what to do."""


@dataclass(frozen=True)
class Keypair:
    """A CURVE keypair, Z85-encoded as ZeroMQ's socket options take them."""

    public: bytes
    secret: bytes
    path: Path  # the secret file it came from (for messages)


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
    """The public key in a NAME.key (or NAME.key_secret) file."""
    path = Path(path).expanduser()
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


def start_authenticator(context: zmq.Context, allowed: list[bytes]):
    """A ZAP authenticator on `context` (a thread, as pyzmq provides it) that admits CURVE clients
    whose public key is in `allowed` and refuses every other; `.stop()` it when done."""
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_Allowed(allowed))
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


class _Allowed:
    """The authenticator's credentials provider: a fixed set of public keys (Z85)."""

    def __init__(self, keys: list[bytes]):
        self.keys = {bytes(key) for key in keys}

    def callback(self, domain: str, z85_key: bytes) -> bool:  # pyzmq passes the client's key Z85-encoded
        return bytes(z85_key) in self.keys


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as error:
        raise CurveKeyError(f"{path} is not a ZeroMQ certificate file ({error}); make keys with "
                        "`layerbus keys new DIR --name NAME`") from None
