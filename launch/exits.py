"""How a layerbus process ends: its exit codes, and the two kinds of error that end it without a
traceback (a mistake the user can fix; work that failed). The CLI reports them (cli/errors.py); the
processes it starts (chain brokers, chain processes) end with the same codes."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the work did not succeed: a job failed or was cancelled, the cluster broke
EXIT_USAGE = 2  # the command cannot be done as given: fix the arguments, the input or the setup
# `layerbus eval compare --fail-on-regression`: a metric is significantly worse. Not 1, so a CI script can tell
# a regression from a comparison that could not run.
EXIT_REGRESSION = 3
# One chain's broker behind `layerbus broker --chains K` (never a command a user runs): its stages broke, it
# left its job to the other chains and sent its surviving stages back to the front door to join them.
# The front door reads it as "no answer about the job" (launch/broker_chains.py, front_door_exit).
EXIT_CHAIN_LEFT = 4
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGTERM: 143)


class UsageError(Exception):
    """A mistake the user can fix; str() names the value and the way out."""


class RunFailed(Exception):
    """The command was fine but the work failed (a stage could not load, the cluster broke); exit 1."""
