"""How the CLI ends: exit codes, and which exceptions are the user's to fix (one message, exit 2,
no traceback) rather than bugs (a traceback)."""

from __future__ import annotations

import sys

from layerbus.launch.exits import (  # noqa: F401 - the CLI's exit codes and error kinds, said once there
    EXIT_CHAIN_LEFT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REGRESSION,
    EXIT_USAGE,
    RunFailed,
    UsageError,
)


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
