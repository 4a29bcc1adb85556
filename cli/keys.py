"""`layerbus keys new DIR [--name NAME]`: a CurveZMQ keypair for a broker or a stage (wire/curve.py).

NAME.key is the public half, to copy to the peers (a stage's into the broker's allowed folder, the
broker's to every stage); NAME.key_secret stays on its machine, readable by its owner only.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from layerbus.cli.errors import EXIT_OK, UsageError
from layerbus.cli.options import add_verbose


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="make CurveZMQ keys for the broker and stages",
                                   description="Make keys that authenticate and encrypt every link of a cluster.")
    actions = parser.add_subparsers(dest="keys_command", metavar="{new}", required=True)
    new = actions.add_parser("new", help="write a keypair (NAME.key public, NAME.key_secret secret) into DIR",
                             description="Write a CurveZMQ keypair into DIR: NAME.key (public: copy it to the "
                                         "peers) and NAME.key_secret (secret: mode 600, never copied). Existing "
                                         "keys are never overwritten.")
    new.add_argument("dir", metavar="DIR", type=Path, help="folder for the key files (created if missing)")
    new.add_argument("--name", default=None, help="file name of the pair (default: this machine's host name)")
    add_verbose(new)
    parser.set_defaults(handler=main)


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
