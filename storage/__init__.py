"""The job store (jobs, items, job events and eval runs in SQLite or PostgreSQL) and the Parquet results of
finished jobs.

The store's names are re-exported here, resolved on first use (PEP 562): `import storage.locations`
or `storage.direct_status` then costs no SQLAlchemy import, which is most of `layerbus status`'s
time. Results live in storage.results (importing it loads pyarrow).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ClaimedItem": "layerbus.storage.records",
    "EvalMetric": "layerbus.storage.eval_records",
    "EvalRun": "layerbus.storage.eval_records",
    "canonical_fingerprint": "layerbus.storage.eval_records",
    "InvalidItem": "layerbus.storage.records",
    "ItemResult": "layerbus.storage.records",
    "JobEvent": "layerbus.storage.status_records",
    "JobSettings": "layerbus.storage.records",
    "JobStatus": "layerbus.storage.status_records",
    "JobWorker": "layerbus.storage.status_records",
    "Finalization": "layerbus.storage.records",
    "Lease": "layerbus.storage.records",
    "NewItem": "layerbus.storage.records",
    "StoreError": "layerbus.storage.errors",
    "JobStore": "layerbus.storage.store",
    "default_db_url": "layerbus.storage.locations",
    "default_results_dir": "layerbus.storage.locations",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from layerbus.storage.errors import StoreError
    from layerbus.storage.eval_records import EvalMetric, EvalRun, canonical_fingerprint
    from layerbus.storage.locations import default_db_url, default_results_dir
    from layerbus.storage.records import (ClaimedItem, Finalization, InvalidItem, ItemResult, JobEvent, JobSettings,
                                          JobStatus, JobWorker, Lease, NewItem)
    from layerbus.storage.store import JobStore


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
