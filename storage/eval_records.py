"""The values of an eval run in the job store: the run (which job, suite and model, its fingerprint,
where its files are) and its aggregated metrics, and the canonical form of a fingerprint."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

# Runs that JobStore.eval_runs and eval_history return by default.
DEFAULT_EVAL_LIMIT = 50


def canonical_fingerprint(fingerprint: Mapping[str, Any]) -> tuple[str, str]:
    """(fingerprint_json, fingerprint_hash) for EvalRun: the JSON with sorted keys and no spaces, and its sha256 hex.

    Two runs have the same hash exactly when their fingerprints hold the same values, whatever the key order.
    The text is json.dumps(sort_keys=True, separators=(",", ":")) with non-ASCII escaped (json's default),
    the canonical form models/fingerprint.py hashes, so both give one hash for one value. NaN is refused.
    """
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return text, fingerprint_hash(text)


def fingerprint_hash(fingerprint_json: str) -> str:
    """The sha256 hex digest of the fingerprint JSON text (UTF-8)."""
    import hashlib  # here, not at the top: `layerbus eval history` reads these records and never hashes

    return hashlib.sha256(fingerprint_json.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class EvalRun:
    """One eval run (a row of eval_runs): the job that scored the documents and what exactly was run."""

    # jobs.id of the eval job; its items are the documents.
    job_id: str
    # Suite name, or "" for an ad-hoc list of tasks.
    suite: str
    # Model name or path, as given.
    model: str
    # sha256 hex of fingerprint_json; equal hashes mean comparable runs.
    fingerprint_hash: str
    # Canonical JSON (canonical_fingerprint): config hash, weight hashes, dtype, wire codecs, tokenizer and
    # chat template hash, layerbus version, settings.
    fingerprint_json: str
    # The eval's settings as JSON text (limit, few-shot, seeds, ...).
    settings_json: str
    # When the run started; aware (read back in UTC).
    created_at: datetime
    # Per-document samples file, once written.
    samples_path: str | None = None
    # Results JSON in lm-evaluation-harness's layout, once written.
    results_path: str | None = None
    # When its metrics were recorded (JobStore.finish_eval_run); None while it runs or if it never finished.
    finished_at: datetime | None = None


@dataclass(frozen=True)
class EvalMetric:
    """One aggregated metric of one task in a run (a row of eval_metrics; lm-eval's "<metric>,<filter>" key)."""

    # Task name, e.g. "arc_easy".
    task: str
    # Metric name, e.g. "acc", "acc_norm", "exact_match", "bits_per_byte".
    metric: str
    # The lm-eval filter the metric was computed under; "none" for unfiltered outputs.
    filter: str
    # The corpus value; float("nan") when undefined (stored as NULL).
    value: float
    # Standard error; None when there is none (lm-eval's "N/A"; a NaN is stored as NULL and read back None).
    stderr: float | None
    # Documents scored for the task.
    n: int


def metric_from_row(row: Sequence[Any]) -> EvalMetric:
    """An EvalMetric from (task, metric, filter, value, stderr, n); a NULL value reads back as NaN.

    Here, apart from the SQLAlchemy modules, because light_sql.eval_history converts rows with it on both
    store paths."""
    task, metric, filter_name, value, stderr, n = row
    return EvalMetric(
        task, metric, filter_name, math.nan if value is None else float(value),
        None if stderr is None or math.isnan(stderr) else float(stderr), int(n),
    )  # fmt: skip


def metric_order(metric: EvalMetric) -> tuple[str, str, str]:
    """The order a run's metrics are returned in: task, metric, filter.

    Sorted in Python, not by ORDER BY: PostgreSQL's collation may order text unlike SQLite's byte order."""
    return (metric.task, metric.metric, metric.filter)
