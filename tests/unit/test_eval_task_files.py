"""Task files: each row kind is read into its document, and every bad row gets one `file:line: message`."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layerbus.evals.documents import (
    GenerationDoc,
    LoglikelihoodDoc,
    MultipleChoiceDoc,
    RollingDoc,
    TaskFileError,
)
from layerbus.evals.task_files import load_task_file


def write_jsonl(tmp_path, rows, name="task.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"id": "q1", "context": "2+2=", "choices": ["4", "5"], "gold": 0},
         MultipleChoiceDoc("q1", "2+2=", ("4", "5"), (0,))),
        ({"id": 7, "context": "", "choices": ["a", "b", "c"], "gold": [0, 2], "group": "g"},
         MultipleChoiceDoc("7", "", ("a", "b", "c"), (0, 2), group="g")),
        ({"id": "l1", "context": "The sky is", "continuation": " blue"},
         LoglikelihoodDoc("l1", "The sky is", " blue")),
        ({"id": "r1", "text": "Some text."}, RollingDoc("r1", "Some text.")),
        ({"id": "g1", "prompt": "Q: 1+1?\nA:", "targets": ["2"], "until": "\n", "max_gen_toks": 8},
         GenerationDoc("g1", "Q: 1+1?\nA:", None, ("2",), ("\n",), 8)),
        ({"id": "g2", "messages": [{"role": "user", "content": "hi"}], "targets": ["hello", "hi"]},
         GenerationDoc("g2", None, ({"role": "user", "content": "hi"},), ("hello", "hi"))),
    ],
)
def test_each_kind_is_read_into_its_document(tmp_path, row, expected):
    task = load_task_file(write_jsonl(tmp_path, [row]))
    assert task.docs == (expected,)


BAD_ROWS = [
    ({"context": "x", "choices": ["a", "b"], "gold": 0}, "missing id"),
    ({"id": "", "text": "x"}, "id must be a non-blank string"),
    ({"id": "a", "context": "x"}, "cannot tell the row's kind"),
    ({"id": "a", "text": "x", "continuation": "y"}, "mixes fields of log-likelihood (continuation) and rolling"),
    ({"id": "a", "context": "x", "choices": ["a", "b"], "gold": 2}, "gold 2 is out of range for 2 choices"),
    ({"id": "a", "context": "x", "choices": ["a"], "gold": 0}, "choices has 1 entries, needs at least 2"),
    ({"id": "a", "context": "x", "choices": ["a", "a"], "gold": 0}, "choices repeat an entry"),
    ({"id": "a", "context": "x", "choices": ["a", "b"], "gold": "a"}, "gold must be a choice index"),
    ({"id": "a", "context": "x", "choices": ["a", "b"]}, "missing gold"),
    ({"id": "a", "context": 3, "continuation": "y"}, "context must be a string, got integer 3"),
    ({"id": "a", "context": "x", "continuation": ""}, "continuation is empty"),
    ({"id": "a", "text": "x", "lenght": 3}, "unknown key(s) 'lenght'"),
    ({"id": "a", "contxt": "x", "continuation": "y"}, "'contxt' (did you mean 'context'?)"),
    ({"id": "a", "prompt": "p"}, "missing targets"),
    ({"id": "a", "prompt": "p", "messages": [], "targets": ["x"]}, "give one of prompt"),
    ({"id": "a", "prompt": "p", "targets": ["x"], "max_gen_toks": 0}, "max_gen_toks must be a positive integer"),
    ({"id": "a", "messages": [{"role": "bot", "content": "x"}], "targets": ["x"]}, "messages[0] needs a role"),
    ({"id": "a", "text": "x", "group": 1.5}, "group must be"),
    ("[1, 2]", "expected a JSON object, got array"),
    ('{"id": "a", ', "malformed JSON"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS)
def test_a_bad_row_is_refused_with_file_line_and_reason(tmp_path, row, message):
    path = write_jsonl(tmp_path, [{"id": "first", "text": "ok"} if _is_rolling(row) else _same_kind_ok(row), row])
    with pytest.raises(TaskFileError) as caught:
        load_task_file(path)
    problems = caught.value.problems
    assert {p.line for p in problems} == {2}
    assert any(message in str(p) and str(p).startswith(f"{path}:2: ") for p in problems), problems


def _is_rolling(row):
    return isinstance(row, dict) and "text" in row and "continuation" not in row


def _same_kind_ok(row):
    # A valid first row of the bad row's kind, so the only problem is the bad row's own.
    if isinstance(row, dict) and ("prompt" in row or "messages" in row):
        return {"id": "first", "prompt": "p", "targets": ["x"]}
    if isinstance(row, dict) and ("continuation" in row or "contxt" in row):
        return {"id": "first", "context": "c", "continuation": "x"}
    return {"id": "first", "context": "c", "choices": ["a", "b"], "gold": 0}


def test_every_problem_is_reported_not_just_the_first(tmp_path):
    rows = [
        {"id": "a", "text": "x"},
        {"id": "a", "text": "y"},
        {"id": "b", "context": "c", "continuation": "d"},
        {"id": "c", "text": ""},
        "",
        "not json",
    ]
    with pytest.raises(TaskFileError) as caught:
        load_task_file(write_jsonl(tmp_path, rows))
    messages = [(p.line, p.message) for p in caught.value.problems]
    assert [line for line, _ in messages] == [2, 3, 4, 6]
    assert "duplicate id 'a': line 1 has it already" in messages[0][1]
    assert "the row is log-likelihood but line 1 made the file rolling log-likelihood" in messages[1][1]
    assert "text is empty" in messages[2][1]
    assert "nothing was queued" in str(caught.value)


def test_parquet_rows_are_numbered_from_one_and_nulls_mean_not_given(tmp_path):
    path = tmp_path / "task.parquet"
    table = pa.table({"id": ["a", "b", None], "text": ["x", "y", "z"], "group": [None, "g", None]})
    pq.write_table(table, path)
    with pytest.raises(TaskFileError) as caught:
        load_task_file(path)
    assert [str(p) for p in caught.value.problems] == [
        f"{path}:3: missing id: every document needs one so its samples row and comparisons can find it"
    ]
    pq.write_table(table.slice(0, 2), path)
    assert load_task_file(path).docs == (RollingDoc("a", "x"), RollingDoc("b", "y", group="g"))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("task.csv", "id,text\n", "unknown task file kind '.csv'"),
        ("empty.jsonl", "\n\n", "no documents found"),
        ("bad.parquet", "not parquet", "cannot be read as Parquet"),
    ],
)
def test_whole_file_problems(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TaskFileError, match=message):
        load_task_file(path)


def test_a_missing_file_says_what_is_accepted(tmp_path):
    with pytest.raises(TaskFileError, match="does not exist; accepted: a .jsonl file"):
        load_task_file(tmp_path / "nope.jsonl")


def test_a_folder_of_text_files_is_a_rolling_task(tmp_path):
    (tmp_path / "b.txt").write_text("Second.\n")
    (tmp_path / "a.txt").write_text("First,\nand more.\n\n")
    (tmp_path / ".hidden.txt").write_text("ignored")
    assert load_task_file(tmp_path).docs == (RollingDoc("a", "First,\nand more."), RollingDoc("b", "Second."))
    (tmp_path / "c.txt").write_bytes(b"\xff bad")
    with pytest.raises(TaskFileError, match=r":3: c.txt is not UTF-8"):
        load_task_file(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskFileError, match="no .txt files in this folder"):
        load_task_file(tmp_path / "empty")
