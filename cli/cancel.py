"""`layerbus cancel`: stop a job; its queued items are cancelled, items in flight finish first."""

from __future__ import annotations

import argparse
import sys

from layerbus.cli.errors import EXIT_OK
from layerbus.cli.options import add_db, command_parser, open_store


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "cancel", main, help="cancel a job (prints its new status)",
                        description="Cancel JOB: queued items become cancelled, items in flight "
                                    "finish, completed outputs are kept. Prints the new status: "
                                    "cancelling (items still in flight) or cancelled.") as parser:
        parser.add_argument("job", metavar="JOB", help="job id (job_...)")
        add_db(parser)


def main(args: argparse.Namespace) -> int:
    from layerbus.storage.direct_cancel import cancel_job_directly
    from layerbus.storage.locations import default_db_url

    # Through the store's driver alone where it can (no SQLAlchemy import: most of this command's time);
    # otherwise, and for every error's wording, the full store.
    new_status = cancel_job_directly(args.db or default_db_url(), args.job)
    if new_status is None:
        with open_store(args.db) as store:
            new_status = store.cancel_job(args.job)
    print(new_status)
    if new_status == "cancelling":
        print(f"layerbus: {args.job} stops once its items in flight finish; follow with "
              f"`layerbus status {args.job} --watch`", file=sys.stderr)
    return EXIT_OK
