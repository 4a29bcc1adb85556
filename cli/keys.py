"""`layerbus keys new DIR [--name NAME]`: a CurveZMQ keypair for a broker or a stage (wire/curve.py).
`layerbus keys api new|list|revoke`: the API keys of `layerbus serve`, kept hashed in the job store.

NAME.key is the public half, to copy to the peers (a stage's into the broker's allowed folder, the
broker's to every stage); NAME.key_secret stays on its machine, readable by its owner only. An API key is
printed once, when it is made; the store keeps only its hash.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from layerbus.cli.errors import EXIT_OK, UsageError
from layerbus.cli.options import add_db, add_verbose


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="make CurveZMQ keys for the broker and stages, and API keys for `serve`",
                                   description="Make keys that authenticate and encrypt every link of a cluster.")
    actions = parser.add_subparsers(dest="keys_command", metavar="{new,api}", required=True)
    new = actions.add_parser("new", help="write a keypair (NAME.key public, NAME.key_secret secret) into DIR",
                             description="Write a CurveZMQ keypair into DIR: NAME.key (public: copy it to the "
                                         "peers) and NAME.key_secret (secret: mode 600, never copied). Existing "
                                         "keys are never overwritten.")
    new.add_argument("dir", metavar="DIR", type=Path, help="folder for the key files (created if missing)")
    new.add_argument("--name", default=None, help="file name of the pair (default: this machine's host name)")
    add_verbose(new)
    new.set_defaults(handler=main)
    _add_api_parser(actions)


def _add_api_parser(actions: argparse._SubParsersAction) -> None:
    api = actions.add_parser("api", help="make, list and revoke the API keys of `layerbus serve`",
                             description="API keys for `layerbus serve`: a client sends one as `Authorization: "
                                         "Bearer KEY` (the openai client's api_key). Each key sees only the files and "
                                         "batches it created, unless it is an admin key.")
    commands = api.add_subparsers(dest="api_command", metavar="{new,list,revoke}", required=True)
    new = commands.add_parser("new", help="make a key and print it (once: the store keeps only its hash)",
                              description="Make an API key named NAME in the store and print it on stdout. It is "
                                          "shown only now: the store keeps its sha256.")
    new.add_argument("name", metavar="NAME", help="who the key is for (letters, digits, . _ -; at most 64)")
    new.add_argument("--admin", action="store_true", help="the key sees every key's files and batches")
    listed = commands.add_parser("list", help="list the keys (names, admin, made, revoked)",
                                 description="List the store's API keys: never the keys themselves.")
    revoke = commands.add_parser("revoke", help="revoke a key: it is refused from then on",
                                 description="Revoke the API key NAME: requests with it are refused from then on.")
    revoke.add_argument("name", metavar="NAME")
    for command, handler in ((new, api_new), (listed, api_list), (revoke, api_revoke)):
        add_db(command)
        add_verbose(command)
        command.set_defaults(handler=handler)


def api_new(args: argparse.Namespace) -> int:
    import re

    from layerbus.serve.auth import key_hash, new_key

    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", args.name):
        raise UsageError(f"API key name {args.name!r}: use letters, digits, '.', '_' and '-' (at most 64)")
    key = new_key()
    with _api_store(args.db) as api:
        api.add_key(args.name, key_hash(key), args.admin)
        where = api.url
    print(key)
    kind = "admin key" if args.admin else "key"
    print(f"layerbus: made the API {kind} {args.name!r} in {where}; it is shown only now", file=sys.stderr)
    return EXIT_OK


def api_list(args: argparse.Namespace) -> int:
    with _api_store(args.db) as api:
        keys = api.keys()
    print(f"{'NAME':<24} {'ADMIN':<5} {'MADE (UTC)':<19} REVOKED (UTC)")
    for key in keys:
        revoked = key.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if key.revoked_at else "-"
        print(f"{key.name:<24} {'yes' if key.admin else 'no':<5} {key.created_at:%Y-%m-%d %H:%M:%S} {revoked}")
    return EXIT_OK


def api_revoke(args: argparse.Namespace) -> int:
    with _api_store(args.db) as api:
        api.revoke_key(args.name)
    print(f"layerbus: revoked the API key {args.name!r}", file=sys.stderr)
    return EXIT_OK


class _api_store:
    """The store's API part, open for one command."""

    def __init__(self, url: str | None) -> None:
        self._url = url

    def __enter__(self):  # type: ignore[no-untyped-def]
        from layerbus.cli.options import open_store
        from layerbus.storage.api_store import ApiStore

        self._store = open_store(self._url)
        return ApiStore(self._store)

    def __exit__(self, *exc_info: object) -> None:
        self._store.close()


def main(args: argparse.Namespace) -> int:
    from layerbus.wire.curve import CurveKeyError, make_keypair

    name = args.name or socket.gethostname().split(".")[0] or "layerbus"
    try:
        public, secret = make_keypair(args.dir, name)
    except CurveKeyError as error:
        raise UsageError(str(error)) from None
    print(public)
    print(f"layerbus: wrote {public} (public: copy it to the peers) and {secret} (secret: keep it here)",
          file=sys.stderr)
    return EXIT_OK
