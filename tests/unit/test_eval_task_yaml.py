"""Task YAML subset: supported keys parse, others are refused by name, few-shot draws and filters match lm-eval."""

from __future__ import annotations

import random

import pytest

from layerbus.evals.task_yaml import (
    FilterStep,
    TaskYamlError,
    apply_filters,
    context_of,
    fewshot_examples,
    parse_task_yaml,
)

GOOD = """
task: capitals
output_type: multiple_choice
dataset_path: json
data_files: {test: test.jsonl, train: train.jsonl}
test_split: test
fewshot_split: train
num_fewshot: 2
description: "Answer the question.\\n\\n"
doc_to_text: "Q: {{question}}\\nA:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list: [{metric: acc}, {metric: acc_norm}]
"""


def test_the_supported_subset_parses():
    task = parse_task_yaml(GOOD)
    assert (task.name, task.output_type, task.num_fewshot, task.target_delimiter) == ("capitals", "multiple_choice", 2, " ")
    docs = [{"question": "Capital of France?", "choices": ["Paris", "Rome"], "answer": 0}]
    shots = [{"question": "2+2?", "choices": ["4", "5"], "answer": 0}]
    assert context_of(task, docs[0], shots) == "Answer the question.\n\nQ: 2+2?\nA: 4\n\nQ: Capital of France?\nA:"


@pytest.mark.parametrize(
    "extra, message",
    [
        ("dataset_name: main", "dataset_name is not supported: hub datasets are not fetched"),
        ("process_docs: !function utils.process_docs", "process_docs: !function hooks are not run"),
        ("doc_to_text: !function utils.doc_to_text", "doc_to_text: !function hooks are not run"),
        ("group: mmlu", "group is not supported: groups are not supported: list the tasks in a suite file"),
        ("frobnicate: 1", "frobnicate is not supported; supported keys:"),
        ("filter_list: [{name: x, filter: [{function: majority_vote}]}]", "filter 'majority_vote' is not supported"),
    ],
)
def test_each_unsupported_key_gets_one_message_naming_it(extra, message):
    text = GOOD.replace("doc_to_text: \"Q: {{question}}\\nA:\"\n", "") if extra.startswith("doc_to_text") else GOOD
    with pytest.raises(TaskYamlError) as caught:
        parse_task_yaml(text + extra + "\n", "t.yaml")
    lines = str(caught.value).splitlines()
    assert len(lines) == 1 and lines[0].startswith("t.yaml: ") and message in lines[0], lines


def test_a_hub_dataset_path_is_refused():
    with pytest.raises(TaskYamlError, match="dataset_path 'gsm8k': give one of json, parquet, csv"):
        parse_task_yaml(GOOD.replace("dataset_path: json", "dataset_path: gsm8k"))


def test_templates_are_sandboxed():
    task = parse_task_yaml(GOOD.replace('"Q: {{question}}\\nA:"', '"{{ question.__class__.__mro__ }}"'))
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        context_of(task, {"question": "x", "choices": ["a"], "answer": 0}, [])


@pytest.mark.parametrize("same_split", [False, True])
def test_fewshot_draws_equal_lm_evals_context_sampler(same_split):
    samplers = pytest.importorskip("lm_eval.api.samplers")
    pool = [{"q": str(i)} for i in range(30)]
    docs = pool[:10] if same_split else [{"q": f"t{i}"} for i in range(10)]
    sampler = samplers.ContextSampler(list(pool), rnd=1234)
    theirs = [sampler.sample(n=3, eval_doc=doc if same_split else None) for doc in docs]
    assert fewshot_examples(pool, docs, 3, 1234, same_split) == theirs


@pytest.mark.parametrize("name, kwargs", [
    ("regex", {"regex_pattern": r"#### (\-?[0-9\.\,]+)"}),
    ("regex", {"regex_pattern": r"answer is (\w+)|(\d+)", "group_select": -1, "fallback": "none"}),
    ("lowercase", {}),
    ("remove_whitespace", {}),
    ("take_first", {}),
])
def test_filters_equal_lm_evals(name, kwargs):
    registry = pytest.importorskip("lm_eval.api.registry")
    import lm_eval.filters  # noqa: F401  (registers the filters)

    theirs = registry.get_filter(name)(**kwargs)
    rng = random.Random(name)
    pieces = ["#### 42", " ", "answer is Paris", "7", "\n", "ABC", "#### -3.5", "x"]
    for _ in range(100):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 5)))
        filtered = list(theirs.apply([[text]], [{}]))[0]
        expected = filtered if name == "take_first" else filtered[0]  # take_first returns the first response
        assert apply_filters(text, (FilterStep(name, **kwargs),)) == expected, text
