"""lm-evaluation-harness drives layerbus: lm-eval's own simple_evaluate with model="layerbus" (evals/lm_eval_adapter.py)
gives what its HF backend gives, resumes an interrupted job without recomputing finished items, and re-reads a
completed job without starting a stage. Tiny models, a few documents, max_length 32 (so contexts are truncated)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")
from lm_eval import evaluator  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from sqlalchemy import create_engine, select  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import layerbus.launch.local_run as local_run  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster  # noqa: E402
from layerbus.evals.lm_eval_adapter import LayerbusLM  # noqa: E402
from layerbus.jobs.runner import StoreSink, StoreSource  # noqa: E402
from layerbus.storage import JobStore  # noqa: E402
from layerbus.storage.results import ResultWriter  # noqa: E402
from layerbus.storage.schema import items as items_table  # noqa: E402
from tests.helpers.lm_eval_reference import MC_YAML, hf_simple_evaluate, offline, working_directory  # noqa: E402
from tests.helpers.tiny_models import TRAINING_TEXT, single_torch_thread  # noqa: E402

pytestmark = pytest.mark.cluster  # every test here starts stage processes

MAX_LENGTH = 32
MC_ROWS = [{"question": f"What is {i} plus {i}? " + "Think of the stage and the layers. " * (i % 3),
            "choices": [str(2 * i), str(2 * i + 1), "a spider"], "gold": i % 3} for i in range(9)]
LINES = TRAINING_TEXT.split("\n")
TEXT_ROWS = [{"text": " ".join(LINES[2 * k: 4 + 3 * k])} for k in range(4)]  # 2 to 5 lines: 2 to 5 windows
ROLLING_YAML = """\
task: tiny_text
output_type: loglikelihood_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: text.jsonl
test_split: test
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
GEN_ROWS = [{"prompt": line[: 20 + 9 * i], "answer": "x"} for i, line in enumerate(TRAINING_TEXT.split("\n")[:5])]
GEN_YAML = """\
task: tiny_gen
output_type: generate_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: gen.jsonl
test_split: test
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: [".", "re"]
  max_gen_toks: 9
  do_sample: false
metric_list:
  - metric: exact_match
"""
TASKS = ("tiny_sums", "tiny_text", "tiny_gen")


@pytest.fixture(scope="module")
def llama(tiny_models) -> Path:
    return tiny_models("llama")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, rows, yaml in (("sums", MC_ROWS, MC_YAML), ("text", TEXT_ROWS, ROLLING_YAML), ("gen", GEN_ROWS, GEN_YAML)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(yaml)
    return folder


def layerbus_simple_evaluate(model: str | LayerbusLM, task_dir: Path, tasks: tuple[str, ...],
                             model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """lm_eval.simple_evaluate on our model, offline, on the local task YAML (as hf_simple_evaluate runs HF's)."""
    with tempfile.TemporaryDirectory(prefix="lm-eval-datasets-") as scratch, offline(Path(scratch)), \
            working_directory(task_dir):
        return evaluator.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), log_samples=True,
                                         bootstrap_iters=0,
                                         task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))


def layerbus_args(model_dir: Path, db: str) -> dict[str, Any]:
    # partition "equal": no stage profiling, the fastest start for a tiny model; one thread per stage.
    return {"pretrained": str(model_dir), "max_length": MAX_LENGTH, "db": db, "partition": "equal",
            "threads_per_stage": 1, "device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def store_a(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('store_a') / 'store.db'}"


@pytest.fixture(scope="module")
def uninterrupted(llama, task_dir, store_a) -> dict[str, Any]:
    """All three tasks through model="layerbus" (the registry path), once per module, into store A."""
    return layerbus_simple_evaluate("layerbus", task_dir, TASKS, layerbus_args(llama, store_a))


@pytest.fixture(scope="module")
def reference(llama, task_dir) -> dict[str, Any]:
    with single_torch_thread():
        return hf_simple_evaluate(llama, task_dir, tasks=list(TASKS), max_length=MAX_LENGTH, log_samples=True,
                                  bootstrap_iters=0)


def responses(results: dict[str, Any], task: str) -> list[Any]:
    """Each document's raw responses (lls, or generated texts) in document order."""
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def lls(results: dict[str, Any], task: str) -> list[list[float]]:
    return [[float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0]) for r in doc]
            for doc in responses(results, task)]


def test_layerbus_is_registered_in_lm_eval():
    assert get_model("layerbus") is LayerbusLM


def test_simple_evaluate_through_layerbus_equals_lm_evals_hf_backend(llama, uninterrupted, reference):
    ours, theirs = uninterrupted["results"], reference["results"]
    assert (ours["tiny_sums"]["acc,none"], ours["tiny_sums"]["acc_norm,none"]) == \
           (theirs["tiny_sums"]["acc,none"], theirs["tiny_sums"]["acc_norm,none"])
    for task in ("tiny_sums", "tiny_text"):
        for doc_ours, doc_theirs in zip(lls(uninterrupted, task), lls(reference, task), strict=True):
            assert doc_ours == pytest.approx(doc_theirs, abs=1e-4), task
    greedy = [[bool(r[0][1]) for r in doc] for doc in responses(uninterrupted, "tiny_sums")]
    assert greedy == [[bool(r[0][1]) for r in doc] for doc in responses(reference, "tiny_sums")]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["tiny_text"][metric] == pytest.approx(theirs["tiny_text"][metric], rel=1e-5), metric
    assert responses(uninterrupted, "tiny_gen") == responses(reference, "tiny_gen")
    assert ours["tiny_gen"]["exact_match,none"] == theirs["tiny_gen"]["exact_match,none"]

    # The documents really needed truncated contexts and prompts, and several rolling windows.
    tokenizer = AutoTokenizer.from_pretrained(llama)
    assert max(len(tokenizer.encode(f"Question: {row['question']}\nAnswer: a spider")) for row in MC_ROWS) > MAX_LENGTH
    assert max(len(tokenizer.encode(row["prompt"])) for row in GEN_ROWS) > MAX_LENGTH - 9
    assert max(len(tokenizer.encode(row["text"])) for row in TEXT_ROWS) > 3 * MAX_LENGTH


def test_a_completed_job_is_read_back_without_starting_stages(llama, task_dir, store_a, uninterrupted, monkeypatch):
    def no_stages(*args, **kwargs):
        raise AssertionError("stages started for a job that was already completed")

    monkeypatch.setattr(LocalCluster, "__enter__", no_stages)
    model = LayerbusLM(**layerbus_args(llama, store_a))
    again = layerbus_simple_evaluate(model, task_dir, ("tiny_sums",))
    assert model.last_job.reused and model.last_job.job_id
    assert again["results"]["tiny_sums"] == uninterrupted["results"]["tiny_sums"]
    assert lls(again, "tiny_sums") == lls(uninterrupted, "tiny_sums")


class Killed(Exception):
    """The lm-eval process died mid-run (kill -9): nothing was handed back."""


class StopsEarly(StoreSource):
    """A run that claims `limit` items and no more: the part of the job done before the kill."""

    def __init__(self, *args: Any, limit: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.left = limit

    def fetch(self, limit: int, ahead: int = 0):
        if self.left <= 0:
            self._exhausted = True
            return []
        requests = super().fetch(min(limit, self.left), ahead=min(ahead, self.left))
        self.left -= len(requests)
        return requests


def killed_after(done: int):
    """A run_job_locally that completes `done` items, claims one more, and dies without handing it back."""

    def run(store: JobStore, job_id: str, config, options, results_dir: Path, progress: bool = True):
        with LocalCluster(config, options) as cluster:
            source = StopsEarly(store, job_id, cluster.broker.tokenizer(), store.job_settings(job_id), "killed",
                                limit=done)
            sink = StoreSink(store, ResultWriter(results_dir, job_id), source.outstanding)
            cluster.broker.run(source, sink, should_stop=lambda: False, events=None)
            sink.flush()
        # In flight when the process died, and its lease has run out since: the resumed run takes it back.
        assert len(store.claim_items(job_id, "killed", 1, lease_s=0.001)) == 1
        raise Killed()

    return run


def item_rows(db: str, job_id: str) -> dict[int, tuple[int, str, Any]]:
    """seq -> (attempts, status, finished_at) straight from the store's items table."""
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(items_table.c.seq, items_table.c.attempts, items_table.c.status,
                                       items_table.c.finished_at).where(items_table.c.job_id == job_id))
            return {row.seq: (row.attempts, row.status, row.finished_at) for row in rows}
    finally:
        engine.dispose()


def test_an_interrupted_job_resumes_without_recomputing_its_finished_items(llama, task_dir, tmp_path, uninterrupted,
                                                                          monkeypatch):
    db = f"sqlite:///{tmp_path / 'store.db'}"
    model = LayerbusLM(**layerbus_args(llama, db))
    done = 4
    with monkeypatch.context() as patch:
        patch.setattr(local_run, "run_job_locally", killed_after(done))
        with pytest.raises(Killed):
            layerbus_simple_evaluate(model, task_dir, ("tiny_sums",))
    with JobStore.open(db) as store:
        (status,) = store.list_jobs()
    job_id = status.job_id
    before = item_rows(db, job_id)
    assert (status.status, status.completed, status.in_progress) == ("in_progress", done, 1)
    # One item per truncated context: 9 questions, and truncation gives the longer choices of the longest ones
    # a shorter context of their own.
    assert status.total > len(MC_ROWS)

    resumed = layerbus_simple_evaluate(model, task_dir, ("tiny_sums",))
    after = item_rows(db, job_id)
    assert model.last_job.job_id == job_id and not model.last_job.reused
    for seq in range(done):  # finished before the kill: untouched
        assert after[seq] == before[seq] and after[seq][0] == 1
    assert after[done][:2] == (2, "completed")  # in flight at the kill: requeued and run again
    assert all(after[seq][:2] == (1, "completed") for seq in range(done + 1, status.total))
    assert resumed["results"]["tiny_sums"] == uninterrupted["results"]["tiny_sums"]
    for doc_resumed, doc_whole in zip(lls(resumed, "tiny_sums"), lls(uninterrupted, "tiny_sums"), strict=True):
        assert doc_resumed == pytest.approx(doc_whole, abs=1e-5)
