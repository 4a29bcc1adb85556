"""Task YAML data files into documents: each loader, limits and seeds, `file:line` problems, and the requests
equal to the ones lm-eval 0.4.13 builds from the same YAML keys and files."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from layerbus.evals.documents import GenerationDoc, MultipleChoiceDoc, RollingDoc, TaskFileError
from layerbus.evals.task_yaml import TaskYamlError
from layerbus.evals.yaml_docs import load_task_yaml, task_docs

ROWS = [{"question": f"Which is bigger, {i} or {i + 3}?", "options": [str(i), str(i + 3)], "label": 1,
         "note": "n" if i % 2 else None} for i in range(12)]
MC_KEYS = {"output_type": "multiple_choice", "doc_to_text": "Q: {{question}}\nA:", "doc_to_choice": "{{options}}",
           "doc_to_target": "label", "description": "Compare numbers.\n\n"}


def write(folder, name, rows, loader):
    path = folder / name
    if loader == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif loader == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows, indent=2))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_task(folder, keys, rows=ROWS, loader="json", name="data.jsonl", **top):
    data = write(folder, name, rows, loader)
    config = {"task": "cmp", "dataset_path": loader, "dataset_kwargs": {"data_files": {"test": data.name}},
              "test_split": "test", **keys, **top}
    (folder / "task.yaml").write_text(yaml.safe_dump(config))
    return folder / "task.yaml"


def load(path, **kwargs):
    return task_docs(load_task_yaml(path), str(path), **kwargs)


@pytest.mark.parametrize("loader, name", [("json", "d.jsonl"), ("json", "d.json"), ("parquet", "d.parquet")])
def test_every_loader_gives_the_same_documents(tmp_path, loader, name):
    (tmp_path / "plain").mkdir()
    plain = load(write_task(tmp_path / "plain", MC_KEYS))
    other = load(write_task(tmp_path, MC_KEYS, loader=loader, name=name))
    assert other.docs == plain.docs
    assert plain.docs[0] == MultipleChoiceDoc("0", "Compare numbers.\n\nQ: Which is bigger, 0 or 3?\nA:", ("0", "3"),
                                              (1,), target_delimiter=" ")


def test_csv_cells_are_typed_per_column(tmp_path):
    rows = [{"question": "q1", "a": "x", "b": "y", "label": 0, "score": 1.5},
            {"question": "q2", "a": "7", "b": "z", "label": 1, "score": ""}]
    keys = {**MC_KEYS, "doc_to_choice": "{{[a, b]}}", "doc_to_text": "{{question}} {{score}}"}
    task = load(write_task(tmp_path, keys, rows, loader="csv", name="d.csv"))
    assert [(d.context.split("\n")[-1], d.choices, d.gold) for d in task.docs] == [
        ("q1 1.5", ("x", "y"), (0,)), ("q2 None", ("7", "z"), (1,))]


def test_limit_ids_and_the_fewshot_seed_are_recorded(tmp_path):
    path = write_task(tmp_path, MC_KEYS, fewshot_split="test", num_fewshot=2)
    full, first = load(path, seed=5), load(path, seed=5, limit=3)
    assert [d.id for d in full.docs] == [str(i) for i in range(12)]
    assert first.docs == full.docs[:3] and (first.n_original, len(first.docs)) == (12, 3)
    assert (first.num_fewshot, first.fewshot_seed, first.config()["fewshot_seed"]) == (2, 5, 5)
    assert load(path).fewshot_seed == 1234 and load(path, seed=6).docs != full.docs
    assert load(path, num_fewshot=0).docs[0].context.count("Q:") == 1


def test_rolling_and_generation_documents(tmp_path):
    rows = [{"passage": "Some text.", "answers": ["a", "b"]}]
    rolling = load(write_task(tmp_path, {"output_type": "loglikelihood_rolling", "doc_to_text": "",
                                         "doc_to_target": "passage"}, rows))
    assert rolling.docs == (RollingDoc("0", "Some text."),)
    generation = load(write_task(tmp_path, {"output_type": "generate_until", "doc_to_text": "{{passage}}",
                                            "doc_to_target": "{{answers}}",
                                            "generation_kwargs": {"until": "\n", "max_gen_toks": 9}}, rows))
    assert generation.docs == (GenerationDoc("0", "Some text.", None, ("a", "b"), ("\n",), 9),)


@pytest.mark.parametrize("content, line, message", [
    ('{"question": "q", "options": ["a", "b"], "label": 0}\n{"question": \n', 2, "malformed JSON"),
    ('{"question": "q", "options": ["a", "b"], "label": 0}\n\n[1]\n', 3, "expected a JSON object (one row), got array"),
    ('[\n {"question": "q", "options": ["a", "b"], "label": 0},\n 5\n]', 3, "expected a JSON object"),
    ('{"question": "q", "options": ["a", "b"], "label": 0}\n{"question": 3, "options": ["a", "b"], "label": 0}\n', 2,
     "doc_to_text: UndefinedError: 'int object' has no attribute 'strip'"),
    ('{"question": "q", "options": ["a", "b"], "label": 2}\n', 1, "gold 2 is out of range for 2 choices"),
    ('{"question": "q", "options": ["a", "a"], "label": 0}\n', 1, "choices repeat an entry"),
    ('{"question": "q", "options": "a, b", "label": 0}\n', 1, "doc_to_choice renders 'a, b', which is not a list literal"),
])
def test_bad_data_gets_file_line_messages(tmp_path, content, line, message):
    path = write_task(tmp_path, {**MC_KEYS, "doc_to_text": "Q: {{question.strip()}}"}, rows=[{}])
    (tmp_path / "data.jsonl").write_text(content)
    with pytest.raises(TaskFileError) as caught:
        load(path)
    assert any(str(p).startswith(f"{tmp_path / 'data.jsonl'}:{line}: ") and message in str(p)
               for p in caught.value.problems), caught.value.problems


def test_a_name_no_column_has_fails_on_every_row(tmp_path):
    with pytest.raises(TaskFileError) as caught:
        load(write_task(tmp_path, {**MC_KEYS, "doc_to_text": "{{questoin}}"}, ROWS[:2]))
    assert [str(p) for p in caught.value.problems] == [
        f"{tmp_path / 'data.jsonl'}:{line}: doc_to_text: UndefinedError: 'questoin' is undefined" for line in (1, 2)]


def test_target_naming_no_choice_and_bad_csv_rows(tmp_path):
    keys = {**MC_KEYS, "doc_to_target": "{{options[0]}}x"}
    with pytest.raises(TaskFileError, match=r"data.jsonl:1: doc_to_target gives '0x', which is none of the choices"):
        load(write_task(tmp_path, keys))
    path = write_task(tmp_path, MC_KEYS, loader="csv", name="d.csv")
    (tmp_path / "d.csv").write_text("question,options,label\nq,\"['a','b']\",0\nq2,a,b,0\n")
    with pytest.raises(TaskFileError, match=r"d.csv:3: 4 fields, the header has 3"):
        load(path)


def test_whole_file_and_yaml_problems(tmp_path):
    path = write_task(tmp_path, MC_KEYS)
    (tmp_path / "data.jsonl").unlink()
    with pytest.raises(TaskFileError, match="cannot read: No such file or directory .data_files paths are relative"):
        load(path)
    with pytest.raises(TaskYamlError, match="2 few-shot examples asked for but the YAML names no fewshot_split"):
        load(write_task(tmp_path, MC_KEYS), num_fewshot=2)
    with pytest.raises(TaskYamlError, match=r"dataset_kwargs: only data_files is read, got \['trust_remote_code'\]"):
        from layerbus.evals.task_yaml import parse_task_yaml

        parse_task_yaml(yaml.safe_dump({"dataset_path": "json", "dataset_kwargs": {
            "data_files": {"test": "x.jsonl"}, "trust_remote_code": True}}))


@pytest.mark.parametrize("loader, name", [("json", "d.jsonl"), ("csv", "d.csv")])
@pytest.mark.parametrize("fewshot_split", ["train", "test"])
def test_requests_equal_lm_evals(tmp_path, monkeypatch, loader, name, fewshot_split):
    """Every (context, continuation) of every document equals lm-eval's build_all_requests on the same files."""
    task_module = pytest.importorskip("lm_eval.api.task")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{k: v for k, v in r.items() if k != "note"} for r in ROWS]
    keys = {**MC_KEYS, "doc_to_choice": "{{[question[-8:-7], question[-2:-1], 'neither']}}"}  # CSV has no lists
    train = write(tmp_path, "train." + name.split(".")[1], rows[:6], loader)
    path = write_task(tmp_path, keys, rows[6:], loader=loader, name=name)
    config = yaml.safe_load(path.read_text())
    config["dataset_kwargs"]["data_files"]["train"] = train.name
    path.write_text(yaml.safe_dump({**config, "fewshot_split": fewshot_split}))
    absolute = {s: str(tmp_path / f) for s, f in config["dataset_kwargs"]["data_files"].items()}
    for num_fewshot, seed, limit in [(0, 1234, None), (2, 1234, None), (3, 9, 4)]:
        theirs = task_module.ConfigurableTask(config={
            **config, "fewshot_split": fewshot_split, "num_fewshot": num_fewshot,
            "dataset_kwargs": {"data_files": absolute, "cache_dir": str(tmp_path / "hf")}})
        theirs.set_fewshot_seed(seed)
        theirs.build_all_requests(limit=limit)
        ours = load(path, num_fewshot=num_fewshot, seed=seed, limit=limit)
        expected = [(str(i.doc_id), i.arguments) for i in theirs.instances]
        assert [(d.id, (d.context, d.target_delimiter + c)) for d in ours.docs for c in d.choices] == expected
