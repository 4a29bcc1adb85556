"""The evals' core test: `layerbus eval run` on 1, 2 and 3 real stage processes scores every document as
lm-evaluation-harness's own HF backend does on the same model (float32): per-document log-likelihoods
within 1e-4 per token, the same is_greedy, and identical acc / acc_norm.

The tasks mix what tokenization can get wrong: an empty context (the prefix token stands in), trailing
spaces (they move to the continuation), contexts long enough to be left-truncated (--max-context 48 is
lm-eval's max_length 48), and rolling texts split into several windows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from layerbus.evals.metrics import multiple_choice_scores
from tests.helpers.lm_eval_reference import hf_lm, hf_loglikelihood, hf_loglikelihood_rolling
from tests.helpers.cli import layerbus, write_jsonl

pytestmark = pytest.mark.cluster  # `layerbus eval run` with its stage processes

MAX_LENGTH = 48
LONG = ("The broker keeps a queue of jobs and every stage holds a range of layers; when a stage stops sending "
        "heartbeats its layers move to the stages left and the job goes on without losing an item. ")
MC_DOCS = [
    {"id": "capital", "context": "Question: What is the capital of France?\nAnswer:",
     "choices": [" Paris", " London", " a small village by the sea", " Rome"], "gold": 0},
    {"id": "empty-context", "context": "", "choices": ["yes", "no", "perhaps not"], "gold": [1, 2]},
    {"id": "trailing-space", "context": "Two plus two is ", "choices": ["four", "five", "twenty-two"], "gold": 0},
    {"id": "truncated", "context": LONG * 2, "choices": [" stages", " heartbeats and layers", " jobs"], "gold": 1,
     "group": "long"},
    {"id": "one-token-choices", "context": "Pick a letter:", "choices": [" A", " B", " C", " D"], "gold": 3,
     "group": "long"},
]
LL_DOCS = [
    {"id": "pair-1", "context": "The stage receives a batch", "continuation": " of hidden states"},
    {"id": "pair-2", "context": "", "continuation": "Nothing is lost when a process dies."},
]
ROLLING_DOCS = [
    {"id": "short", "text": "Small models are useful in tests."},
    {"id": "windows", "text": LONG * 3},
]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("eval-tasks")
    return {"mc": write_jsonl(folder / "mc.jsonl", MC_DOCS), "ll": write_jsonl(folder / "ll.jsonl", LL_DOCS),
            "rolling": write_jsonl(folder / "rolling.jsonl", ROLLING_DOCS)}


def eval_run(home: Path, model_dir: Path, task_files, stages: int, *extra) -> dict:
    result = layerbus(home, "eval", "run", *task_files, "--model", model_dir, "--stages", stages, "--max-context",
                      MAX_LENGTH, "--partition", "equal", "--json", *extra, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def samples_by_task(outcome: dict) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for row in pq.read_table(outcome["samples"]).to_pylist():
        out.setdefault(row["task"], {})[row["doc_id"]] = row
    return out


def reference(model_dir: Path) -> dict[str, dict[str, dict]]:
    """lm-eval's HF backend on the same documents: lls, is_greedy, token counts."""
    lm = hf_lm(model_dir, MAX_LENGTH)
    mc = {}
    for doc in MC_DOCS:
        scored = hf_loglikelihood(lm, [(doc["context"], choice) for choice in doc["choices"]])
        gold = doc["gold"] if isinstance(doc["gold"], list) else [doc["gold"]]
        tokens = [len(lm._encode_pair(doc["context"], c)[1]) if doc["context"] else len(lm.tok_encode(c))
                  for c in doc["choices"]]
        mc[doc["id"]] = {"lls": [ll for ll, _ in scored], "is_greedy": [g for _, g in scored], "tokens": tokens,
                         **multiple_choice_scores([ll for ll, _ in scored], doc["choices"], gold)}
    ll = {}
    for doc in LL_DOCS:
        ((value, greedy),) = hf_loglikelihood(lm, [(doc["context"], doc["continuation"])])
        ll[doc["id"]] = {"lls": [value], "is_greedy": [greedy], "tokens": [len(lm.tok_encode(doc["continuation"]))]}
    rolling = {doc["id"]: {"lls": [value], "tokens": [len(lm.tok_encode(doc["text"]))]}
               for doc, value in zip(ROLLING_DOCS, hf_loglikelihood_rolling(lm, [d["text"] for d in ROLLING_DOCS]))}
    return {"mc": mc, "ll": ll, "rolling": rolling}


def assert_matches_lm_eval(outcome: dict, expected: dict[str, dict[str, dict]]) -> None:
    got = samples_by_task(outcome)
    assert set(got) == set(expected)
    for task, docs in expected.items():
        assert set(got[task]) == set(docs), task
        for doc_id, want in docs.items():
            row = got[task][doc_id]
            assert len(row["lls"]) == len(want["lls"]), (task, doc_id)
            for ours, theirs, tokens in zip(row["lls"], want["lls"], want["tokens"]):
                assert abs(ours - theirs) <= 1e-4 * max(tokens, 1), (task, doc_id, ours, theirs)
            if "is_greedy" in want:
                assert list(row["is_greedy"]) == want["is_greedy"], (task, doc_id)
            for metric in ("acc", "acc_norm"):
                if metric in want:
                    assert row[metric] == want[metric], (task, doc_id, metric)
    metrics = {(m["task"], m["metric"]): m for m in outcome["metrics"]}
    for metric in ("acc", "acc_norm"):
        values = [doc[metric] for doc in expected["mc"].values()]
        assert metrics[("mc", metric)]["value"] == pytest.approx(sum(values) / len(values), abs=1e-12)
        assert metrics[("mc", metric)]["n"] == len(MC_DOCS)


@pytest.fixture(scope="module")
def llama(tiny_models):
    model_dir = tiny_models("llama", num_hidden_layers=4)
    return model_dir, reference(model_dir)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_tiny_llama_scores_as_lm_eval_hf(llama, tasks, tmp_path, stages):
    model_dir, expected = llama
    outcome = eval_run(tmp_path / "home", model_dir, tasks.values(), stages)
    assert_matches_lm_eval(outcome, expected)


@pytest.mark.parametrize("arch", ["qwen2", "gemma"])
def test_other_tiny_architectures_score_as_lm_eval_hf(tiny_models, tasks, tmp_path, arch):
    model_dir = tiny_models(arch, num_hidden_layers=4)
    outcome = eval_run(tmp_path / "home", model_dir, tasks.values(), 2)
    assert_matches_lm_eval(outcome, reference(model_dir))


def test_default_model_scores_as_lm_eval_hf(default_model, tasks, tmp_path):
    """The real model on 3 stages (two hops). That 1 and 2 stages score as 3 do is proven by
    test_tiny_llama_scores_as_lm_eval_hf; what only the real model shows (its tokenizer's prefix token,
    spaces and truncation against lm-eval's) is proven here once."""
    outcome = eval_run(tmp_path / "home", default_model, tasks.values(), 3)
    assert_matches_lm_eval(outcome, reference(default_model))
