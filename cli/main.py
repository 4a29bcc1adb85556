"""The `layerbus` console script: one subcommand per module of this package, dispatched here.

Subcommand modules import torch, transformers and the broker inside their handlers, so `layerbus
status` and `--help` stay fast. Errors the user can fix print one line of advice and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

from layerbus.cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, failure_message, user_error_message
from layerbus.models.openmp_waits import prefer_passive_waits

# Each subcommand: its module in this package and its line in `layerbus --help`. Only the module of the
# command given is imported (each imports what its options need: a read-only command must not pay
# for the others' imports); the others are listed by these lines. tests/unit/test_cli_main.py checks that
# each line is the one its module registers.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("submit", "queue a job (prints its id)"),
    "run": ("run", "submit and run a job on local stage processes"),
    "status": ("status", "show recent jobs, or one job's progress"),
    "top": ("top", "watch a job's stages as they work (host, layers, busy %%, step time, memory, links)"),
    "results": ("results", "print the path of a job's Parquet results"),
    "cancel": ("cancel", "cancel a job (prints its new status)"),
    "eval": ("eval_commands", "run evals, compare runs, show a suite's history"),
    "broker": ("broker_service", "run a broker for stages started elsewhere"),
    "stage": ("stage", "run one stage process (see `layerbus stage --help`)"),
    "plan": ("plan", "show how the model's layers would be placed on a cluster"),
    "model": ("model", "prepare the default model or import a GGUF"),
    "serve": ("serve", "serve OpenAI's Files and Batch API and a dashboard over the job store"),
    "keys": ("keys", "make CurveZMQ keys for the broker and stages, and API keys for `serve`"),
    "wire-quality": ("wire_quality", "measure what each wire codec costs in quality"),
    "quality": ("quality", "measure what each weight format and wire codec costs in quality"),
    "netprobe": ("netprobe", "measure round trips and bandwidth to another machine, and what they cost per token"),
}


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its first word that is not an option), None when there is none."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(load: Callable[[str], bool] = lambda name: True) -> argparse.ArgumentParser:
    """The whole parser; subcommands for which `load(name)` is False get only their help line."""
    parser = argparse.ArgumentParser(
        prog="layerbus",
        description="Offline batch inference over a model split into stage processes.",
        epilog="Exit codes: 0 done, 1 the job or cluster failed (or the job was cancelled), 2 a usage error "
               "(the message says what to fix), 3 a regression (eval compare --fail-on-regression), "
               "130 interrupted.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress to stderr (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_line) in SUBCOMMANDS.items():
        if load(name):
            importlib.import_module(f"layerbus.cli.{module}").add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=help_line)
    return parser


def configure_logging(verbosity: int) -> None:
    """Warnings always; layerbus's INFO with -v, its DEBUG with -vv. All on stderr."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if verbosity:
        logging.getLogger("layerbus").setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)


def main(argv: list[str] | None = None) -> int:
    prefer_passive_waits()  # before any command imports torch (models/openmp_waits.py says why)
    command = chosen_command(sys.argv[1:] if argv is None else argv)
    parser = build_parser(lambda name: name == command)
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if extra and not getattr(args, "takes_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `broker --chains K` starts brokers with these
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
