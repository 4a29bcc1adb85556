"""How the CLI ends: exit codes, and which exceptions are the user's to fix (one message, exit 2,
no traceback) rather than bugs (a traceback)."""

from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_FAILED = 1  # the work did not succeed: a job failed or was cancelled, the cluster broke
EXIT_USAGE = 2  # the command cannot be done as given: fix the arguments, the input or the setup
# `layerbus eval compare --fail-on-regression`: a metric is significantly worse. Not 1, so a CI script can tell
# a regression from a comparison that could not run.
EXIT_REGRESSION = 3
# One chain's broker behind `layerbus broker --chains K` (never a command a user runs): its stages broke, it
# left its job to the other chains and sent its surviving stages back to the front door to join them.
# The front door reads it as "no answer about the job" (cli/broker_chains.py, front_door_exit).
EXIT_CHAIN_LEFT = 4
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGTERM: 143)


class UsageError(Exception):
    """A mistake the user can fix; str() names the value and the way out."""


class RunFailed(Exception):
    """The command was fine but the work failed (a stage could not load, the cluster broke); exit 1."""


def user_error_message(error: BaseException) -> str | None:
    """The message to show for an exception the user can act on, or None for a bug.

    Error classes of heavy modules are only looked up when those modules are loaded: an exception
    cannot come from a module nobody imported, and importing one here would slow every command.
    """
    if isinstance(error, (UsageError, FileNotFoundError)):
        return str(error)
    from layerbus.jobs.records import InputError
    from layerbus.storage.errors import StoreError

    if isinstance(error, (StoreError, InputError)):
        return str(error)
    for module, names in _HEAVY_USER_ERRORS.items():
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(error, tuple(getattr(loaded, name) for name in names)):
            return str(error)
    return None


def failure_message(error: BaseException) -> str | None:
    """The message for a runtime failure that needs no traceback (exit 1), or None."""
    if isinstance(error, RunFailed):
        return str(error)
    control = sys.modules.get("layerbus.broker.control")
    if control is not None and isinstance(error, control.ClusterError):
        return str(error)
    return None


_HEAVY_USER_ERRORS = {
    "layerbus.models.model_files": ("ModelDirError",),
    "layerbus.models.default_model": ("DefaultModelError",),
    "layerbus.models.gguf_import": ("GGUFImportError",),
    "layerbus.planner.placement": ("PlacementError",),
    "layerbus.planner.cluster_file": ("ClusterFileError",),
    "layerbus.planner.wire_choice": ("WireConfigError",),
    "layerbus.evals.suites": ("SuiteError",),
    "layerbus.evals.documents": ("TaskFileError",),
    "layerbus.evals.task_yaml": ("TaskYamlError",),
}
