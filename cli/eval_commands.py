"""`layerbus eval`: score tasks through the pipeline (run), compare two runs document by document
(compare), and follow a suite's metrics night after night (history). One module per subcommand."""

from __future__ import annotations

import argparse

from layerbus.cli import eval_compare, eval_history, eval_run

EVAL_SUBCOMMANDS = (eval_run, eval_compare, eval_history)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="run evals, compare runs, show a suite's history",
                                   description="Evals comparable with lm-evaluation-harness: same tokenization, "
                                               "same metric definitions, standard errors, paired comparisons.")
    commands = parser.add_subparsers(dest="eval_command", metavar="SUBCOMMAND")
    for module in EVAL_SUBCOMMANDS:
        module.add_parser(commands)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)
