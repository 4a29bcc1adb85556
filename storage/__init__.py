"""The job store (jobs and items in SQLite or PostgreSQL) and the Parquet results of finished jobs."""

from storage.engine import default_db_url, default_results_dir
from storage.errors import StoreError
from storage.records import ClaimedItem, InvalidItem, ItemResult, JobSettings, JobStatus, NewItem
from storage.results import ResultWriter, read_results, results_metadata
from storage.store import JobStore

__all__ = [
    "ClaimedItem",
    "InvalidItem",
    "ItemResult",
    "JobSettings",
    "JobStatus",
    "JobStore",
    "NewItem",
    "ResultWriter",
    "StoreError",
    "default_db_url",
    "default_results_dir",
    "read_results",
    "results_metadata",
]
