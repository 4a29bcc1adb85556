"""The few-shot prompt layout: context_of equals lm-eval 0.4.13's ConfigurableTask.fewshot_context, byte for byte.

lm-eval builds its task offline from a config dict over local JSON Lines files (datasets' json loader, a cache
under tmp_path); ours parses the same keys as task YAML. Both draw examples with one seeded sampler per task.
"""

from __future__ import annotations

import json

import pytest
import yaml

from layerbus.evals.task_yaml import context_of, fewshot_examples, parse_task_yaml

QUESTIONS = [f"What is {i} plus {i}?" for i in range(14)]
MC_ROWS = [{"question": q, "choices": [f"{2 * i} in all", f"{2 * i + 1} in all", f"{i} apples"], "answer": i % 3, "topic": "sums"}
           for i, q in enumerate(QUESTIONS)]
GEN_ROWS = [{"question": f"Name  {i}", "answers": [f"n{i}", f"N{i}"] if i % 4 else [f"only{i}"], "label": "" if i == 5 else f"x{i}"}
            for i in range(14)]

CONFIGS = {
    # Description rendered against the document, integer gold by column, separate splits.
    "mc-column-target": (MC_ROWS, {
        "output_type": "multiple_choice", "description": "Questions about {{topic}}.\n",
        "doc_to_text": "Q: {{question}}\nA:", "doc_to_choice": "{{choices}}", "doc_to_target": "answer"}),
    # Gold as the choice's text from a template, delimiters of the task's own.
    "mc-text-target": (MC_ROWS, {
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "choices",
        "doc_to_target": "{{choices[answer]}}", "target_delimiter": " => ", "fewshot_delimiter": "\n---\n"}),
    # Choices as a YAML list, a digit-string target from a template.
    "mc-literal-choices": (MC_ROWS, {
        "output_type": "multiple_choice", "doc_to_text": "{{question}} Even?", "doc_to_choice": ["yes", "no", "maybe"],
        "doc_to_target": "{{answer}}", "description": "Answer yes or no.\n\n"}),
    # Generation: a list target (the first is the example's answer), an empty one (no delimiters), regex_replace.
    "generate-list-target": (GEN_ROWS, {
        "output_type": "generate_until", "doc_to_text": "{{question | regex_replace('\\\\s+', ' ')}}:",
        "doc_to_target": "{{answers}}"}),
    "generate-empty-target": (GEN_ROWS, {
        "output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "label",
        "fewshot_delimiter": "\n"}),
}


def write_splits(tmp_path, rows):
    for split, part in (("train", rows[:9]), ("test", rows[9:])):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl")}


def lm_eval_task(tmp_path, config, data_files, fewshot_split, num_fewshot):
    task_module = pytest.importorskip("lm_eval.api.task")
    dataset_kwargs = {"data_files": data_files, "cache_dir": str(tmp_path / "hf-cache")}
    return task_module.ConfigurableTask(config={
        "task": "t", "dataset_path": "json", "dataset_kwargs": dataset_kwargs, "test_split": "test",
        "fewshot_split": fewshot_split, "num_fewshot": num_fewshot, **config})


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fewshot_split", ["train", "test"])
def test_context_equals_lm_evals_fewshot_context(tmp_path, monkeypatch, name, fewshot_split):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows, config = CONFIGS[name]
    data_files = write_splits(tmp_path, rows)
    theirs_task = lm_eval_task(tmp_path, config, data_files, fewshot_split, 0)
    ours_task = parse_task_yaml(yaml.safe_dump({
        "task": "t", "dataset_path": "json", "data_files": data_files, "test_split": "test",
        "fewshot_split": fewshot_split, **config}))
    test_docs = [dict(d) for d in theirs_task.test_docs()]
    pool = [dict(d) for d in theirs_task.dataset[fewshot_split]]
    assert test_docs == [json.loads(line) for line in open(data_files["test"])]  # the rows are the same data
    for num_fewshot in (0, 1, 2, 4):
        for seed in (0, 1234, 7):
            theirs_task.set_fewshot_seed(seed)
            theirs = [theirs_task.fewshot_context(doc, num_fewshot) for doc in theirs_task.test_docs()]
            shots = fewshot_examples(pool, test_docs, num_fewshot, seed, same_split=fewshot_split == "test")
            ours = [context_of(ours_task, doc, examples) for doc, examples in zip(test_docs, shots)]
            assert ours == theirs, (num_fewshot, seed)
