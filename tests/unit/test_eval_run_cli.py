"""`layerbus eval run`'s refusals, in this process and before any model or stage: a bad task file or an
unsupported task YAML key gets one clear message, exit 2, and nothing is queued."""

from __future__ import annotations

import pytest

from layerbus.cli.main import main
from layerbus.storage import JobStore
from tests.helpers.cli import write_jsonl


@pytest.fixture
def store_url(tmp_path):
    return f"sqlite:///{tmp_path / 'store.db'}"


def eval_run(capsys, store_url, *args) -> tuple[int, str]:
    code = main(["eval", "run", *map(str, args), "--db", store_url, "--model", "/nonexistent/model"])
    return code, capsys.readouterr().err


def assert_nothing_queued(store_url: str) -> None:
    with JobStore.open(store_url) as store:
        assert store.list_jobs() == [] and store.eval_runs(include_unfinished=True) == []


def test_a_bad_task_file_is_refused_line_by_line_and_nothing_is_queued(capsys, store_url, tmp_path):
    task = write_jsonl(tmp_path / "mc.jsonl", [
        {"id": "q1", "context": "Q?", "choices": [" a", " b"], "gold": 0},
        {"id": "q2", "context": "Q?", "choices": [" a", " b"], "gold": 5},
        '{"id": "q3", "context": ',
    ])
    code, err = eval_run(capsys, store_url, task)
    assert code == 2
    assert f"{task}:2:" in err and "gold" in err and f"{task}:3:" in err
    assert "nothing was queued" in err
    assert_nothing_queued(store_url)


def test_an_unsupported_yaml_key_is_named_with_the_way_out(capsys, store_url, tmp_path):
    (tmp_path / "data.jsonl").write_text('{"q": "x", "a": 0}\n')
    task = tmp_path / "task.yaml"
    task.write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data.jsonl\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
                    "doc_to_choice: ['a', 'b']\ndoc_to_target: a\nprocess_docs: !function utils.process\n")
    code, err = eval_run(capsys, store_url, task)
    assert code == 2 and "process_docs" in err and err.count("\n") <= 4, err
    assert_nothing_queued(store_url)


@pytest.mark.parametrize("args, message", [
    ((), "give TASK files or --suite NAME"),
    (("--suite", "no-such-suite"), "no such suite file, and no bundled suite of that name (bundled: nightly)"),
    (("--job", "job_000000000000", "x.jsonl"), "--job runs the eval as it was queued"),
])
def test_usage_errors(capsys, store_url, args, message):
    code, err = eval_run(capsys, store_url, *args)
    assert code == 2 and message in err, err
