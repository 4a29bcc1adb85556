"""The job store (jobs and items in SQLite or PostgreSQL) and the Parquet results of finished jobs.

The store's names are re-exported here; results live in storage.results (importing it loads pyarrow,
which processes that only claim and complete items do not need).
"""

from storage.engine import default_db_url, default_results_dir
from storage.errors import StoreError
from storage.records import ClaimedItem, InvalidItem, ItemResult, JobSettings, JobStatus, NewItem
from storage.store import JobStore

__all__ = [
    "ClaimedItem",
    "InvalidItem",
    "ItemResult",
    "JobSettings",
    "JobStatus",
    "JobStore",
    "NewItem",
    "StoreError",
    "default_db_url",
    "default_results_dir",
]
