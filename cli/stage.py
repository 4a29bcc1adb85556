"""`layerbus stage`: one stage process, with exactly the options of `python -m layerbus.stages`."""

from __future__ import annotations

import argparse

from layerbus.cli.errors import UsageError

STAGE_DESCRIPTION = ("Run one stage: register with the broker at --broker, load the layers it assigns, serve "
                     "steps until the broker says stop, SIGTERM/Ctrl-C, or the broker goes silent.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    # The stage's own options are added when the command runs: stages.__main__ imports torch, which
    # every other command (and --help) would pay for. Its arguments reach main() as args.extra.
    parser = subparsers.add_parser("stage", help="run one stage process (see `layerbus stage --help`)",
                                   add_help=False, description=STAGE_DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS)
    parser.set_defaults(handler=main, takes_extra=True)


def stage_parser() -> argparse.ArgumentParser:
    from layerbus.stages.__main__ import add_stage_arguments

    parser = argparse.ArgumentParser(prog="layerbus stage", description=STAGE_DESCRIPTION)
    add_stage_arguments(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    from layerbus.stages.__main__ import config_from_args
    from layerbus.stages.worker import run_stage

    stage_args = stage_parser().parse_args(args.extra)
    try:
        config = config_from_args(stage_args)
    except ValueError as error:  # keys that cannot be used, or an exposed bind without them
        raise UsageError(str(error)) from None
    return run_stage(config)
