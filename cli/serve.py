"""`layerbus serve`: OpenAI's Files and Batch API over the job store, and the dashboard, on one HTTP port
(serve/). Starts without torch: the server imports the model code only to validate a batch's input."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerbus.cli.errors import EXIT_OK, UsageError
from layerbus.cli.options import add_db, command_parser, positive_int

DEFAULT_BIND = "127.0.0.1:8000"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "serve", main,
                        help="serve OpenAI's Files and Batch API and a dashboard over the job store",
                        description="Serve OpenAI's Files and Batch API (/v1/files, /v1/batches) and a dashboard "
                                    "(/) over the job store: point the openai client's base_url at "
                                    "http://HOST:PORT/v1. Batches become jobs that brokers of their model run.") as parser:
        add_db(parser)
        parser.add_argument("--bind", metavar="HOST:PORT", default=DEFAULT_BIND,
                            help=f"where to listen (default: {DEFAULT_BIND}); any bind other machines can reach "
                                 "needs API keys (`layerbus keys api new NAME`) unless --insecure")
        parser.add_argument("--insecure", action="store_true",
                            help="serve a bind other machines can reach without requiring API keys (requests "
                                 "without a key act as one anonymous user)")
        parser.add_argument("--model", metavar="DIR", action="append", type=Path, default=[],
                            help="a model directory batches may name in body.model (by its path or directory "
                                 "name); repeatable. Prepared models (`layerbus model`) are found by name anyway")
        parser.add_argument("--files-dir", metavar="DIR", type=Path, default=None,
                            help="where uploaded and output files are kept (default: files/ under $LAYERBUS_HOME)")
        parser.add_argument("--max-file-lines", metavar="N", type=positive_int, default=1_000_000,
                            help="the most lines an uploaded file may have (default: 1000000)")


def parse_bind(bind: str) -> tuple[str, int]:
    host, colon, port = bind.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--bind {bind!r} is not HOST:PORT: give e.g. 127.0.0.1:8000 or 0.0.0.0:8000")
    return host, int(port)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from layerbus.serve.app import create_app
    from layerbus.serve.config import ServeConfig
    from layerbus.serve.server import Server
    from layerbus.storage import JobStore, default_db_url
    from layerbus.storage.locations import layerbus_home
    from layerbus.wire.curve import is_loopback_host

    host, port = parse_bind(args.bind)
    keys = "optional" if args.insecure else "once_made" if is_loopback_host(host) else "required"
    for model in args.model:
        if not (model / "config.json").is_file():
            raise UsageError(f"--model {model}: no config.json there; give a Hugging Face model directory")
    config = ServeConfig(db_url=args.db or default_db_url(), files_dir=args.files_dir or layerbus_home() / "files",
                         keys=keys, models=tuple(m.expanduser().absolute() for m in args.model),
                         max_file_lines=args.max_file_lines)
    server = Server(config, JobStore.open(config.db_url))
    said = {"required": "required", "once_made": "required once `layerbus keys api new` has made one",
            "optional": "optional (--insecure)"}[keys]
    announce = f"layerbus serve: listening on http://{args.bind} (API at http://{args.bind}/v1; keys {said})"
    if args.insecure and not is_loopback_host(host):
        print(f"layerbus serve: warning: --insecure: {args.bind} is reachable from other machines and serves "
              "anyone without a key", file=sys.stderr)
    uvicorn.run(create_app(server, announce), host=host, port=port, log_level="warning",
                access_log=bool(getattr(args, "verbose", 0)), timeout_graceful_shutdown=5)
    return EXIT_OK
