"""Helpers for the `eval compare` and `eval history` tests: finished eval runs recorded straight into a
SQLite store, with samples Parquet files whose rows are shaped as doc_results.samples_rows gives them, and
metrics aggregated from those rows as finalize_eval does. No model, no job run: the numbers are chosen here.

`store_url` and `store` are that SQLite store's fixtures, imported by name into the modules that use them."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from layerbus.evals import metrics
from layerbus.evals.doc_results import SAMPLE_COLUMNS, SCORE_COLUMNS, metric_items, write_samples
from layerbus.evals.documents import MULTIPLE_CHOICE, ROLLING
from layerbus.storage import EvalMetric, EvalRun, JobSettings, JobStore, NewItem, canonical_fingerprint

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
FINGERPRINT = {"model": {"config": "c" * 64, "weights": {"model.safetensors": "w" * 64}, "tokenizer": "t" * 64,
                         "chat_template": None},
               "dtype": "float32", "wire": "float32", "layerbus": "0.1.0", "max_length": 2048, "limit": None,
               "num_fewshot": [0], "seed": 1234}  # fmt: skip
FAILED = "the item failed: stage lost three times"
BASE = [True] * 60 + [False] * 40  # acc 0.6 over 100 documents
ACC_ONLY = {"mc": ["acc"]}


def mc_row(task: str, doc_id: str, correct: bool | None, margin: float = 1.0, prompt_hash: str | None = None,
           group: str | None = None) -> dict:
    """A four-choice document, gold choice 0: its ll beats the best other one by `margin` when correct, trails it by
    `margin` when not; correct=None is a failed document (error, NaN scores, no lls)."""
    row = dict.fromkeys(SAMPLE_COLUMNS)
    row.update(task=task, doc_id=doc_id, kind=MULTIPLE_CHOICE, filter="none", group=group,
               prompt_hash=prompt_hash or f"hash-{task}-{doc_id}", gold=[0], lls=[], is_greedy=[], tokens=[])
    if correct is None:
        return {**row, "error": FAILED, "acc": math.nan, "acc_norm": math.nan}
    lls = [-2.0 + (margin if correct else -margin), -2.0, -3.0, -4.0]
    # Every choice one token and the same length, so acc_norm is acc.
    acc = 1.0 if metrics.argmax(lls) == 0 else 0.0
    return {**row, "lls": lls, "is_greedy": [False] * 4, "tokens": [1] * 4, "acc": acc, "acc_norm": acc}


def rolling_row(task: str, doc_id: str, ll: float | None, n_bytes: int = 100, words: int = 20) -> dict:
    """A rolling (bits per byte) document with the text's log-likelihood `ll`; None is a failed document."""
    row = dict.fromkeys(SAMPLE_COLUMNS)
    row.update(task=task, doc_id=doc_id, kind=ROLLING, filter="none", prompt_hash=f"hash-{task}-{doc_id}",
               words=words, bytes=n_bytes, lls=[], is_greedy=[], tokens=[])
    if ll is None:
        return {**row, "error": FAILED, "ll": math.nan}
    return {**row, "lls": [ll], "is_greedy": [False], "tokens": [n_bytes // 4], "ll": ll}


def mc_task(task: str, outcomes: Sequence[bool | None], margins: Sequence[float] | None = None) -> list[dict]:
    return [mc_row(task, f"q{i:03d}", ok, margins[i] if margins else 1.0) for i, ok in enumerate(outcomes)]


def flipped(outcomes: Sequence[bool], lose: Sequence[int] = (), gain: Sequence[int] = ()) -> list[bool]:
    """The outcomes with the documents at `lose` made wrong and those at `gain` made right (asserting they were not)."""
    changed = list(outcomes)
    for i in lose:
        assert changed[i], f"document {i} is already wrong"
        changed[i] = False
    for i in gain:
        assert not changed[i], f"document {i} is already right"
        changed[i] = True
    return changed


@dataclass(frozen=True)
class RecordedRun:
    job_id: str
    samples_path: Path
    metrics: list[EvalMetric]


def task_metrics(rows: Sequence[dict], metric_names: dict[str, Sequence[str]]) -> list[EvalMetric]:
    """Each task's metrics over its scored rows, as finalize_eval records them (n: the documents scored)."""
    found = []
    for task, names in metric_names.items():
        scored = [r for r in rows if r["task"] == task and r["error"] is None]
        for name in names:
            items = metric_items(scored, name)
            # A corpus metric's bootstrap standard error is slow and beside the point here: a fixed one instead.
            stderr = metrics.stderr(name, items) if name in SCORE_COLUMNS else 0.01
            found.append(EvalMetric(task, name, "none", metrics.aggregate(name, items), stderr, len(items)))
    return found


def record_run(store: JobStore, folder: Path, rows: Sequence[dict], metric_names: dict[str, Sequence[str]],
               suite: str = "nightly", created_at: datetime = T0, finish: bool = True,
               **fingerprint_changes: object) -> RecordedRun:
    """A finished eval run of `suite` holding `rows`: job, eval_runs row, samples file, metrics."""
    job_id = store.create_job(JobSettings(task="eval", model="tiny", name=suite),
                              [NewItem(f"{r['task']}/{r['doc_id']}", "{}", "", {}, i) for i, r in enumerate(rows)],
                              now=created_at)
    fingerprint_json, fingerprint_hash = canonical_fingerprint({**FINGERPRINT, **fingerprint_changes})
    settings = json.dumps({"suite": suite, "tasks": [{"name": task} for task in metric_names]})
    store.record_eval_run(EvalRun(job_id, suite, "/models/tiny", fingerprint_hash, fingerprint_json, settings,
                                  created_at))
    path = folder / f"{job_id}.samples.parquet"
    found = task_metrics(rows, metric_names)
    if finish:
        write_samples(path, rows)
        store.finish_eval_run(job_id, path, None, found, now=created_at + timedelta(hours=1))
    return RecordedRun(job_id, path, found)


def nightly(store: JobStore, folder: Path, rows_per_night: Sequence[Sequence[dict]],
            metric_names: dict[str, Sequence[str]], suite: str = "nightly") -> list[RecordedRun]:
    """One run per night, a day apart, oldest first."""
    return [record_run(store, folder, rows, metric_names, suite, T0 + timedelta(days=night))
            for night, rows in enumerate(rows_per_night)]


@pytest.fixture
def store_url(tmp_path):
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def store(store_url):
    with JobStore.open(store_url) as opened:
        yield opened
