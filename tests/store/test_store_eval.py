"""Eval runs and their metrics in the job store: every test runs against a SQLite file and a real PostgreSQL server."""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import delete, text

from layerbus.storage.engine import open_engine
from layerbus.storage.errors import StoreError
from layerbus.storage.eval_records import EvalMetric, EvalRun, canonical_fingerprint
from layerbus.storage.records import JobSettings, NewItem
from layerbus.storage.schema import jobs as jobs_table
from layerbus.storage.store import JobStore
from tests.helpers.fixtures_stores import store, store_url  # noqa: F401 - fixtures

T0 = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
FINGERPRINT = {"config_sha256": "c" * 64, "dtype": "float32", "wire": ["int8"], "layerbus": "0.1.0"}
SCHEMA_DOC = Path(__file__).resolve().parents[2] / "storage" / "SCHEMA.md"
# The example query of storage/SCHEMA.md, verbatim: it must run on both backends.
NIGHTLY_ACC_SQL = """\
SELECT r.created_at, r.job_id, r.model, m.task, m.value, m.stderr, m.n
FROM eval_runs r JOIN eval_metrics m ON m.job_id = r.job_id
WHERE r.suite = 'nightly' AND r.finished_at IS NOT NULL AND m.metric = 'acc' AND m.filter = 'none'
ORDER BY r.created_at, m.task;"""
FINGERPRINT_CHANGED_SQL = """\
SELECT job_id, created_at, model FROM (
  SELECT job_id, created_at, model, fingerprint_hash,
         lag(fingerprint_hash) OVER (ORDER BY created_at, job_id) AS previous_hash
  FROM eval_runs WHERE suite = 'nightly' AND finished_at IS NOT NULL
) AS runs WHERE previous_hash IS NOT NULL AND fingerprint_hash <> previous_hash;"""


def eval_job(store: JobStore, now: datetime = T0) -> str:
    items = [NewItem(f"doc-{i}", f"question {i}", f"prompt {i}", {}, i) for i in range(3)]
    return store.create_job(JobSettings(task="eval", model="tiny-model", name="nightly"), items, now=now)


def new_run(job_id: str, suite: str = "nightly", created_at: datetime = T0, **fingerprint_extra: object) -> EvalRun:
    fingerprint_json, fingerprint_hash = canonical_fingerprint({**FINGERPRINT, **fingerprint_extra})
    return EvalRun(job_id, suite, "tiny-model", fingerprint_hash, fingerprint_json, '{"limit": 3}', created_at)


def recorded(store: JobStore, suite: str = "nightly", created_at: datetime = T0, finish: bool = True,
             acc: float = 0.5, dtype: str = "float32") -> str:
    """A recorded run (finished a minute after it started, with acc and acc_norm of arc_easy, unless not finish)."""
    job_id = eval_job(store, created_at)
    store.record_eval_run(new_run(job_id, suite, created_at, dtype=dtype))
    if finish:
        metrics = [EvalMetric("arc_easy", "acc", "none", acc, 0.01, 3),
                   EvalMetric("arc_easy", "acc_norm", "none", 0.6, None, 3)]
        store.finish_eval_run(job_id, None, None, metrics, now=created_at + timedelta(minutes=1))
    return job_id


def eval_queries(doc: str) -> list[str]:
    """The SQL statements of SCHEMA.md's eval example block."""
    block = doc.split("Eval runs (the same SQL in SQLite and PostgreSQL):\n\n```sql\n", 1)[1].split("```", 1)[0]
    return [statement.strip() for statement in block.split(";\n") if statement.strip()]


def count(store_url: str, sql: str) -> int:
    engine = open_engine(store_url)
    with engine.connect() as conn:
        value = conn.execute(text(sql)).scalar_one()
    engine.dispose()
    return value


def test_a_run_round_trips_and_is_listed_only_once_finished(store: JobStore) -> None:
    job_id = eval_job(store)
    run = new_run(job_id)
    store.record_eval_run(run)
    assert store.eval_run(job_id) == run
    assert store.eval_run(job_id).created_at.tzinfo == timezone.utc
    assert store.eval_metrics(job_id) == []
    assert store.eval_runs() == [] and store.eval_runs(include_unfinished=True) == [run]

    metrics = [
        EvalMetric("hellaswag", "acc", "none", 0.25, 0.125, 3),
        EvalMetric("arc_easy", "acc_norm", "none", 0.75, None, 2),
        EvalMetric("arc_easy", "acc", "none", 2 / 3, 0.3333, 3),
        EvalMetric("gsm8k", "exact_match", "strict-match", 0.0, 0.0, 3),
    ]
    store.finish_eval_run(job_id, "/evals/s.jsonl", Path("/evals/r.json"), metrics, now=T0 + timedelta(hours=1))
    finished = store.eval_run(job_id)
    assert (finished.samples_path, finished.results_path) == ("/evals/s.jsonl", "/evals/r.json")
    assert finished.finished_at == T0 + timedelta(hours=1)
    assert finished.fingerprint_hash == run.fingerprint_hash and finished.fingerprint_json == run.fingerprint_json
    assert store.eval_metrics(job_id) == [metrics[2], metrics[1], metrics[3], metrics[0]]  # task, metric, filter
    assert store.eval_runs() == [finished]


def test_the_fingerprint_is_canonical_whatever_the_key_order() -> None:
    first = canonical_fingerprint({"dtype": "bfloat16", "weights": {"b": "2", "a": "1"}})
    second = canonical_fingerprint({"weights": {"a": "1", "b": "2"}, "dtype": "bfloat16"})
    assert first == second
    assert first[0] == '{"dtype":"bfloat16","weights":{"a":"1","b":"2"}}'
    assert first[1] == hashlib.sha256(first[0].encode()).hexdigest()
    assert canonical_fingerprint({"dtype": "float16"})[1] != first[1]
    # Non-ASCII is escaped, as json.dumps does by default: the same text, and hash, as models/fingerprint.py's.
    assert canonical_fingerprint({"model": "/mod\u00e8les/x"})[0] == '{"model":"/mod\\u00e8les/x"}'
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        canonical_fingerprint({"temperature": float("nan")})


def test_finishing_again_replaces_the_metrics_and_paths(store: JobStore, store_url: str) -> None:
    job_id = eval_job(store)
    store.record_eval_run(new_run(job_id))
    before = [EvalMetric("arc_easy", "acc", "none", 0.5, 0.1, 3),
              EvalMetric("arc_easy", "acc_norm", "none", 0.4, 0.1, 3)]
    store.finish_eval_run(job_id, "/a/samples.jsonl", "/a/results.json", before, now=T0 + timedelta(minutes=1))
    after = [EvalMetric("arc_easy", "acc", "none", 0.75, 0.05, 3), EvalMetric("piqa", "acc", "none", 1.0, 0.0, 3)]
    store.finish_eval_run(job_id, "/b/samples.jsonl", None, after, now=T0 + timedelta(minutes=2))

    assert store.eval_metrics(job_id) == after
    run = store.eval_run(job_id)
    assert (run.samples_path, run.results_path) == ("/b/samples.jsonl", None)
    assert run.finished_at == T0 + timedelta(minutes=2)
    assert count(store_url, "SELECT count(*) FROM eval_metrics") == 2
    assert count(store_url, "SELECT max(c) FROM (SELECT count(*) AS c FROM eval_metrics "
                            "GROUP BY job_id, task, metric, filter) AS per_key") == 1


def test_a_failed_finish_writes_nothing(store: JobStore) -> None:
    job_id = recorded(store, acc=0.5)
    twice = [EvalMetric("piqa", "acc", "none", 0.1, None, 3), EvalMetric("piqa", "acc", "none", 0.2, None, 3)]
    repeated = r"task 'piqa' metric 'acc' filter 'none' appears more than once.*nothing was written"
    with pytest.raises(ValueError, match=repeated):
        store.finish_eval_run(job_id, "/x", "/y", twice)
    with pytest.raises(ValueError, match=r"n=-1 of task 'piqa' must be a whole number >= 0"):
        store.finish_eval_run(job_id, "/x", "/y", [EvalMetric("piqa", "acc", "none", 0.1, None, -1)])
    assert [(m.metric, m.value) for m in store.eval_metrics(job_id)] == [("acc", 0.5), ("acc_norm", 0.6)]
    assert store.eval_run(job_id).samples_path is None


def test_runs_are_listed_newest_first_by_suite(store: JobStore) -> None:
    oldest = recorded(store, "nightly", T0)
    adhoc = recorded(store, "", T0 + timedelta(hours=1))
    tied = sorted(recorded(store, "nightly", T0 + timedelta(days=1)) for _ in range(2))
    running = recorded(store, "nightly", T0 + timedelta(days=2), finish=False)
    assert [r.job_id for r in store.eval_runs()] == [tied[1], tied[0], adhoc, oldest]
    assert [r.job_id for r in store.eval_runs("nightly")] == [tied[1], tied[0], oldest]
    assert [r.job_id for r in store.eval_runs("nightly", limit=2)] == [tied[1], tied[0]]
    assert [r.job_id for r in store.eval_runs("")] == [adhoc]
    assert [r.job_id for r in store.eval_runs("nightly", include_unfinished=True)][0] == running
    assert store.eval_runs("weekly") == []
    with pytest.raises(ValueError, match="eval_runs needs limit >= 1, got limit=0"):
        store.eval_runs(limit=0)


def test_previous_run_is_the_latest_finished_one_of_the_suite_before(store: JobStore) -> None:
    first = recorded(store, "nightly", T0)
    recorded(store, "weekly", T0 + timedelta(hours=12))  # another suite
    second = recorded(store, "nightly", T0 + timedelta(days=1))
    recorded(store, "nightly", T0 + timedelta(days=1, hours=1), finish=False)  # crashed: never finished
    third = recorded(store, "nightly", T0 + timedelta(days=2))
    later = recorded(store, "nightly", T0 + timedelta(days=3))
    assert store.previous_eval_run("nightly", third).job_id == second
    assert store.previous_eval_run("nightly", second).job_id == first
    assert store.previous_eval_run("nightly", first) is None
    assert store.previous_eval_run("weekly", third).suite == "weekly"
    assert store.previous_eval_run("nightly", later).job_id == third
    # Runs started at the same instant are ordered by job id, as eval_runs lists them.
    low, high = sorted([recorded(store, "tie", T0), recorded(store, "tie", T0)])
    assert store.previous_eval_run("tie", high).job_id == low
    assert store.previous_eval_run("tie", low) is None


def test_history_is_oldest_first_and_filters_by_metric(store: JobStore) -> None:
    runs = [recorded(store, "nightly", T0 + timedelta(days=d), acc=d / 10) for d in range(4)]
    recorded(store, "weekly", T0 + timedelta(days=5))
    recorded(store, "nightly", T0 + timedelta(days=6), finish=False)
    history = store.eval_history("nightly", metric="acc")
    assert [run.job_id for run, _ in history] == runs
    assert [[(m.task, m.metric, m.value, m.stderr, m.n) for m in metrics] for _, metrics in history] == [
        [("arc_easy", "acc", d / 10, 0.01, 3)] for d in range(4)
    ]
    last_two = store.eval_history("nightly", limit=2)
    assert [run.job_id for run, _ in last_two] == runs[2:]
    assert [[m.metric for m in metrics] for _, metrics in last_two] == [["acc", "acc_norm"], ["acc", "acc_norm"]]
    assert [metrics for _, metrics in store.eval_history("nightly", metric="bleu")] == [[], [], [], []]
    assert store.eval_history("monthly") == []


def test_nan_is_stored_as_null_and_read_back_as_nan(store: JobStore, store_url: str) -> None:
    job_id = eval_job(store)
    store.record_eval_run(new_run(job_id))
    metrics = [
        EvalMetric("t", "mcc", "none", float("nan"), float("nan"), 3),
        EvalMetric("t", "perplexity", "none", float("inf"), 1.5, 3),
    ]
    store.finish_eval_run(job_id, None, None, metrics)
    mcc, perplexity = store.eval_metrics(job_id)
    assert math.isnan(mcc.value) and mcc.stderr is None and (mcc.task, mcc.metric, mcc.n) == ("t", "mcc", 3)
    assert perplexity.value == math.inf and perplexity.stderr == 1.5
    assert count(store_url, "SELECT count(*) FROM eval_metrics WHERE value IS NULL AND stderr IS NULL") == 1
    ((_, history),) = store.eval_history("nightly", metric="mcc")
    assert math.isnan(history[0].value)


def test_a_missing_run_names_the_job_and_where_runs_are_listed(store: JobStore) -> None:
    job_id = eval_job(store)  # a job, but no eval run recorded for it
    expected = (
        f"no eval run {job_id} in {store.url}: that job has no recorded eval run (it is not an eval, or its run "
        "was never recorded); `SELECT job_id, suite, created_at FROM eval_runs ORDER BY created_at DESC` "
        "lists the recorded runs"
    )
    for call in (
        lambda: store.eval_run(job_id),
        lambda: store.eval_metrics(job_id),
        lambda: store.previous_eval_run("nightly", job_id),
        lambda: store.finish_eval_run(job_id, None, None, []),
    ):
        with pytest.raises(StoreError) as raised:
            call()
        assert str(raised.value) == expected


def test_recording_needs_the_job_and_only_once(store: JobStore) -> None:
    with pytest.raises(StoreError) as raised:
        store.record_eval_run(new_run("job_missing"))
    assert str(raised.value) == (
        f"cannot record an eval run for job 'job_missing': no such job in {store.url}; create the eval job first "
        "(its items are the documents), `layerbus status` lists the jobs"
    )
    job_id = recorded(store)
    with pytest.raises(StoreError, match=rf"an eval run of job {job_id} is already recorded in .*finish_eval_run\(\)"):
        store.record_eval_run(new_run(job_id, "other"))
    assert store.eval_run(job_id).suite == "nightly" and len(store.eval_metrics(job_id)) == 2


def test_a_run_whose_hash_or_json_or_clock_is_wrong_is_refused(store: JobStore) -> None:
    job_id = eval_job(store)
    run = new_run(job_id)
    mismatch = r"fingerprint_hash '0{64}' is not the sha256 of its fingerprint_json \([0-9a-f]{64}\); build both with"
    with pytest.raises(ValueError, match=mismatch):
        store.record_eval_run(EvalRun(**{**run.__dict__, "fingerprint_hash": "0" * 64}))
    with pytest.raises(ValueError, match="settings_json is not JSON text"):
        store.record_eval_run(EvalRun(**{**run.__dict__, "settings_json": "limit=3"}))
    with pytest.raises(ValueError, match="naive datetime 2030-01-02T03:04:05.678901 as created_at"):
        store.record_eval_run(EvalRun(**{**run.__dict__, "created_at": T0.replace(tzinfo=None)}))
    assert store.eval_runs(include_unfinished=True) == []


def test_deleting_the_job_deletes_its_run_and_metrics(store: JobStore, store_url: str) -> None:
    # JobStore has no delete; users delete with SQL, through layerbus's connection settings (SQLite's foreign keys).
    job_id, kept = recorded(store), recorded(store, created_at=T0 + timedelta(days=1))
    engine = open_engine(store_url)
    with engine.begin() as conn:
        conn.execute(delete(jobs_table).where(jobs_table.c.id == job_id))
    engine.dispose()
    assert count(store_url, "SELECT count(*) FROM eval_runs") == 1
    assert count(store_url, f"SELECT count(*) FROM eval_metrics WHERE job_id = '{kept}'") == 2
    assert count(store_url, "SELECT count(*) FROM eval_metrics") == 2
    with pytest.raises(StoreError, match=f"no eval run {job_id}"):
        store.eval_run(job_id)


def test_the_documented_queries_run_and_answer(store: JobStore, store_url: str) -> None:
    doc = SCHEMA_DOC.read_text()
    assert NIGHTLY_ACC_SQL in doc and FINGERPRINT_CHANGED_SQL in doc
    first = recorded(store, "nightly", T0, acc=0.25)
    recorded(store, "weekly", T0 + timedelta(hours=1), acc=0.9, dtype="bfloat16")
    recorded(store, "nightly", T0 + timedelta(hours=2), finish=False, dtype="bfloat16")
    second = recorded(store, "nightly", T0 + timedelta(days=1), acc=0.5, dtype="bfloat16")
    third = recorded(store, "nightly", T0 + timedelta(days=2), acc=0.5, dtype="bfloat16")
    fourth = recorded(store, "nightly", T0 + timedelta(days=3), acc=0.75)
    engine = open_engine(store_url)
    with engine.connect() as conn:
        acc = conn.execute(text(NIGHTLY_ACC_SQL.rstrip(";"))).all()
        changed = conn.execute(text(FINGERPRINT_CHANGED_SQL.rstrip(";"))).all()
        answers = [conn.execute(text(sql.replace("job_0123456789ab", first))).all() for sql in eval_queries(doc)]
    engine.dispose()
    assert len(answers) == 4 and len(answers[1]) == 2 and len(answers[3]) == 1  # first's 2 metrics; 1 unfinished
    assert [(job_id, task, value, stderr, n) for _, job_id, _, task, value, stderr, n in acc] == [
        (first, "arc_easy", 0.25, 0.01, 3), (second, "arc_easy", 0.5, 0.01, 3),
        (third, "arc_easy", 0.5, 0.01, 3), (fourth, "arc_easy", 0.75, 0.01, 3),
    ]  # fmt: skip
    assert [job_id for job_id, _, _ in changed] == [second, fourth]


def test_a_store_made_before_the_eval_tables_gains_them_on_open(store_url: str) -> None:
    with JobStore.open(store_url) as old:
        job_id = eval_job(old)
    engine = open_engine(store_url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE eval_metrics"))
        conn.execute(text("DROP TABLE eval_runs"))
    engine.dispose()
    with JobStore.open(store_url) as reopened:
        reopened.record_eval_run(new_run(job_id))
        reopened.finish_eval_run(job_id, None, None, [EvalMetric("t", "acc", "none", 1.0, None, 3)])
        assert [m.value for m in reopened.eval_metrics(job_id)] == [1.0]
