"""`layerbus model`: prepare the default model, or import a GGUF file as a model directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerbus.cli.errors import EXIT_OK
from layerbus.cli.options import add_verbose, resolve_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="prepare the default model or import a GGUF",
                                   description="Model directories for --model.")
    add_verbose(parser)
    actions = parser.add_subparsers(dest="model_command", metavar="{default,import-gguf}", required=True)
    default = actions.add_parser("default", help="print the default model's directory, preparing it on first use",
                                 description="Print the directory of SmolLM2-135M-Instruct, downloading and "
                                             "importing it on first use (about 30 s, once).")
    add_verbose(default)
    default.set_defaults(handler=print_default)
    gguf = actions.add_parser("import-gguf", help="convert a GGUF file into a model directory",
                              description="Convert FILE (a GGUF) into a safetensors model directory at --out.")
    gguf.add_argument("file", metavar="FILE", help="the .gguf file")
    gguf.add_argument("--out", metavar="DIR", required=True, help="model directory to create (must not exist)")
    add_verbose(gguf)
    gguf.set_defaults(handler=import_gguf_file)


def print_default(args: argparse.Namespace) -> int:
    print(resolve_model(None))
    return EXIT_OK


def import_gguf_file(args: argparse.Namespace) -> int:
    from layerbus.models.gguf_import import import_gguf

    print(f"layerbus: importing {args.file} into {args.out}", file=sys.stderr)
    print(import_gguf(Path(args.file), Path(args.out)))
    return EXIT_OK
