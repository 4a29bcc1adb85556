"""The `layerbus` console script: one subcommand per module of this package, dispatched here.

Subcommand modules import torch, transformers and the broker inside their handlers, so `layerbus
status` and `--help` stay fast. Errors the user can fix print one line of advice and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from layerbus.cli import (broker_service, cancel, eval_commands, keys, model, netprobe, plan, results, run, stage,
                          status, submit, top, wire_quality)
from layerbus.cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, failure_message, user_error_message

SUBCOMMANDS = (submit, run, status, top, results, cancel, eval_commands, broker_service, stage, plan, model, keys,
               wire_quality, netprobe)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layerbus",
        description="Offline batch inference over a model split into stage processes.",
        epilog="Exit codes: 0 done, 1 the job or cluster failed (or the job was cancelled), 2 a usage error "
               "(the message says what to fix), 3 a regression (eval compare --fail-on-regression), "
               "130 interrupted.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress to stderr (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def configure_logging(verbosity: int) -> None:
    """Warnings always; layerbus's INFO with -v, its DEBUG with -vv. All on stderr."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if verbosity:
        logging.getLogger("layerbus").setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if extra and not getattr(args, "takes_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    configure_logging(args.verbose)
    try:
        return args.handler(args)
    except KeyboardInterrupt as interrupt:
        return getattr(interrupt, "exit_code", EXIT_INTERRUPTED)
    except Exception as error:
        message = user_error_message(error)
        code = EXIT_USAGE
        if message is None:
            message, code = failure_message(error), EXIT_FAILED
        if message is None:
            raise  # a bug: the traceback is what a report needs
        separator = "\n" if "\n" in message else " "  # a list of problems starts on its own line
        print(f"layerbus {args.command}: error:{separator}{message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
