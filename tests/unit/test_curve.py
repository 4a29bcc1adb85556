"""CurveZMQ keys and sockets (wire/curve.py) on real ZeroMQ sockets: an allowed client talks to a
server, while a client with an unknown key, one with no key, and one that mistakes the server's
key are refused in the handshake, and nothing they send is ever received. Key files: written with
owner-only secrets, never overwritten, and refused when readable by others."""

from __future__ import annotations

import os
import stat

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from layerbus.wire.curve import (
    CurveKeyError,
    allowed_keys,
    make_keypair,
    read_keypair,
    read_public_key,
    secure_client,
    secure_server,
    start_authenticator,
)

WAIT_MS = 20_000  # generous: only ever waited on for an event that does come


@pytest.fixture
def keys(tmp_path):
    for name in ("server", "friend", "stranger"):
        make_keypair(tmp_path / name, name)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "friend.key").write_bytes((tmp_path / "friend" / "friend.key").read_bytes())
    return tmp_path


def _handshake_events(socket: zmq.Socket) -> zmq.Socket:
    return socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _next_handshake(monitor: zmq.Socket) -> int:
    assert monitor.poll(WAIT_MS), "no handshake event"
    return recv_monitor_message(monitor)["event"]


def test_only_allowed_keys_get_through_and_refused_peers_deliver_nothing(keys) -> None:
    context = zmq.Context()
    authenticator = start_authenticator(context, allowed_keys(keys / "allowed"))
    sockets = []
    try:
        server_keys = read_keypair(keys / "server")
        server = context.socket(zmq.PULL)
        sockets.append(server)
        secure_server(server, server_keys)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"

        def client(keypair, server_public) -> tuple[zmq.Socket, zmq.Socket]:
            socket = context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            sockets.append(socket)
            if keypair is not None:
                secure_client(socket, keypair, server_public)
            monitor = _handshake_events(socket)
            sockets.append(monitor)
            socket.connect(address)
            return socket, monitor

        stranger, stranger_events = client(read_keypair(keys / "stranger"), server_keys.public)
        stranger.send(b"from a stranger")
        assert _next_handshake(stranger_events) == zmq.EVENT_HANDSHAKE_FAILED_AUTH

        plain, plain_events = client(None, None)
        plain.send(b"in the clear")
        assert _next_handshake(plain_events) in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                                 zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

        # The friend's key is allowed, but it was told the wrong server key (a man in the middle's).
        misled, misled_events = client(read_keypair(keys / "friend"), read_public_key(keys / "stranger" / "stranger.key"))
        misled.send(b"to the wrong server")
        assert _next_handshake(misled_events) != zmq.EVENT_HANDSHAKE_SUCCEEDED

        friend, friend_events = client(read_keypair(keys / "friend"), server_keys.public)
        friend.send(b"hello")
        assert _next_handshake(friend_events) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert server.poll(WAIT_MS) and server.recv() == b"hello", "the allowed client's message arrives, alone"
        friend.send(b"again")
        assert server.recv() == b"again"
        assert not server.poll(0), "nothing from the refused peers ever arrived"
    finally:
        for socket in sockets:
            socket.close(linger=0)
        authenticator.stop()
        context.term()


def test_key_files_are_owner_only_and_never_overwritten(tmp_path) -> None:
    public, secret = make_keypair(tmp_path / "keys", "stage-a")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and (public.stat().st_mode & stat.S_IROTH)
    assert read_keypair(secret).public == read_public_key(public) == read_keypair(tmp_path / "keys").public
    with pytest.raises(CurveKeyError, match="never overwritten"):
        make_keypair(tmp_path / "keys", "stage-a")
    os.chmod(secret, 0o644)
    with pytest.raises(CurveKeyError, match="readable by others.*chmod 600"):
        read_keypair(secret)
    with pytest.raises(CurveKeyError, match="no secret key"):
        os.chmod(public, 0o600)
        read_keypair(public)
    make_keypair(tmp_path / "keys", "stage-b")
    with pytest.raises(CurveKeyError, match="exactly one \\*.key_secret file"):
        read_keypair(tmp_path / "keys")
    with pytest.raises(CurveKeyError, match="holds no \\*.key files"):
        allowed_keys(tmp_path / "keys" / "..")
    with pytest.raises(CurveKeyError, match="plain file name"):
        make_keypair(tmp_path / "keys", "../escape")
