"""A dataset's own column names: named with --id-column / --text-column / --prompt-column / --messages-column
or inferred when only one column fits, nested fields dotted, in every format that has columns."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layerbus.jobs import arrow_inputs
from layerbus.jobs.columns import ColumnMap, choose_columns
from layerbus.jobs.inputs import FirstIds, read_inputs, stream_outcomes
from layerbus.jobs.records import InputProblem

DOC_BODY = ColumnMap(id="doc_id", text="body")
ROWS = [{"doc_id": "d1", "body": "First body.", "highlights": "h1"},
        {"doc_id": "d2", "body": "Second body.", "highlights": "h2"}]


def write_table(tmp_path, kind: str, rows: list[dict] = ROWS):
    path = tmp_path / f"in.{kind}"
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "arrow":
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        separator = "," if kind == "csv" else "\t"
        names = list(rows[0])
        lines = [separator.join(names)] + [separator.join(str(row[n]) for n in names) for row in rows]
        path.write_text("\n".join(lines) + "\n")
    return path


def texts(result) -> list[tuple[str, str]]:
    assert not result.problems, [str(p) for p in result.problems]
    return [(r.custom_id, r.text) for r in result.records]


@pytest.mark.parametrize("kind", ["parquet", "arrow", "csv", "tsv", "jsonl"])
def test_named_columns_are_read_in_every_format_and_the_others_ignored(tmp_path, kind):
    path = write_table(tmp_path, kind)
    expected = [("d1", "First body."), ("d2", "Second body.")]
    assert texts(read_inputs(path, "summarize", DOC_BODY)) == expected
    assert texts(read_inputs(path, "summarize")) == expected, "doc_id and body are inferred: only they fit"


@pytest.mark.parametrize("kind", ["parquet", "arrow", "jsonl"])
def test_a_nested_field_is_a_dotted_name(tmp_path, kind):
    rows = [{"id": 7, "translation": {"en": "Paragraph one.", "de": "Absatz eins."}}]
    path = write_table(tmp_path, kind, rows)
    result = read_inputs(path, "translate", ColumnMap(text="translation.de"))
    assert texts(result) == [("7", "Absatz eins.")]
    if kind == "jsonl":
        return  # a line with an id key is the simple form, whose slips are each line's own problems
    [problem] = read_inputs(path, "translate").problems
    assert "translation.de" in problem.message and "translation.en" in problem.message, problem.message
    assert "--text-column NAME" in problem.message


@pytest.mark.parametrize("kind", ["parquet", "arrow", "csv", "jsonl"])
def test_a_bad_mapping_is_one_message_listing_the_columns_found(tmp_path, kind):
    path = write_table(tmp_path, kind)
    [problem] = read_inputs(path, "summarize", ColumnMap(id="doc_id", text="bodyy")).problems
    assert "--text-column 'bodyy' (did you mean 'body'?)" in problem.message
    assert "doc_id, body, highlights" in problem.message
    assert "first line" not in problem.message


@pytest.mark.parametrize("kind", ["parquet", "arrow", "csv"])
def test_ambiguous_columns_are_named_with_the_option_to_pass(tmp_path, kind):
    rows = [{"key": "a", "article": "One.", "body": "Two."}]
    [problem] = read_inputs(write_table(tmp_path, kind, rows), "summarize").problems
    assert problem.message == ("more than one column could hold the text (article, body); columns found: key, "
                               "article, body; pass --text-column NAME")


def test_parquet_and_arrow_never_speak_of_a_first_line(tmp_path):
    rows = [{"a": "x", "b": "y"}]
    for kind in ("parquet", "arrow"):
        [problem] = read_inputs(write_table(tmp_path, kind, rows), "summarize").problems
        assert "first line" not in problem.message and "columns found: a, b" in problem.message
    [problem] = read_inputs(write_table(tmp_path, "csv", rows), "summarize").problems
    assert problem.message.startswith("the first line must be a header") and "--id-column" in problem.message


def test_prompt_and_messages_columns_for_generate(tmp_path):
    messages = [{"role": "user", "content": "Hello?"}]
    rows = [{"qid": "q1", "chat": messages, "other": "x"}]
    path = write_table(tmp_path, "parquet", rows)
    [record] = read_inputs(path, "generate", ColumnMap(id="qid", messages="chat")).records
    assert record.messages == messages
    [record] = read_inputs(write_table(tmp_path, "csv", [{"qid": "q1", "question": "Why?"}]), "generate",
                           ColumnMap(id="qid", prompt="question")).records
    assert record.prompt == "Why?"
    [problem] = read_inputs(path, "summarize", ColumnMap(prompt="chat")).problems
    assert "--prompt-column is for --task generate" in problem.message


def test_a_folder_of_text_files_refuses_column_options(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    [problem] = read_inputs(tmp_path, "summarize", ColumnMap(text="body")).problems
    assert "drop --text-column" in problem.message


def test_a_save_to_disk_folder_is_read_and_a_dict_of_splits_is_named(tmp_path):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list([{"id": str(n), "document": f"Doc {n}.", "summary": "s"} for n in range(5)])
    dataset.save_to_disk(str(tmp_path / "saved"))
    result = read_inputs(tmp_path / "saved", "summarize")
    assert texts(result) == [(str(n), f"Doc {n}.") for n in range(5)]
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "splits"))
    [problem] = read_inputs(tmp_path / "splits", "summarize").problems
    assert "several splits (train, test)" in problem.message and str(tmp_path / "splits" / "train") in problem.message


def test_parquet_streams_a_record_batch_at_a_time_with_rows_numbered_across_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(arrow_inputs, "BATCH_ROWS", 3)
    rows = [{"doc_id": f"d{n}", "body": f"Body {n}." if n != 5 else None} for n in range(1, 9)]
    path = write_table(tmp_path, "parquet", rows)
    found = list(stream_outcomes(path, "summarize", FirstIds(), DOC_BODY))
    assert len(found) == 8 and not any(isinstance(f, InputProblem) for f in found)
    assert [f.line for f in found if f.problems] == [5]
    assert found[4].problems[0].message.startswith("missing body (text)")


@pytest.mark.parametrize(
    "names, given, expected",
    [
        (["id", "text"], ColumnMap(), ColumnMap(id="id", text="text")),
        (["doc_id", "article", "highlights"], ColumnMap(), ColumnMap(id="doc_id", text="article")),
        (["id", "document", "summary"], ColumnMap(), ColumnMap(id="id", text="document")),
        (["uid", "title", "max_tokens"], ColumnMap(), ColumnMap(id="uid", text="title")),
        (["a_id", "b_id", "text"], ColumnMap(), "more than one column could hold the id (a_id, b_id)"),
        (["a_id", "b_id", "text"], ColumnMap(id="b_id"), ColumnMap(id="b_id", text="text")),
        (["id", "x", "y"], ColumnMap(), "no content column: none is named text; columns found: id, x, y; "
                                        "pass --text-column NAME"),
        (["x", "body"], ColumnMap(), "no id column: none is named custom_id or id"),
        (["id", "body"], ColumnMap(id="body", text="body"), "column 'body' is named for two roles"),
    ],
)
def test_choose_columns(names, given, expected):
    chosen, problem = choose_columns(names, "summarize", given)
    if isinstance(expected, ColumnMap):
        assert (chosen, problem) == (expected, None)
    else:
        assert chosen is None and expected in problem


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl"])
def test_submit_takes_the_column_options_and_stores_one_item_per_row(tmp_path, tiny_models, kind, capsys):
    from layerbus.cli.main import main
    from layerbus.storage import JobStore

    path = write_table(tmp_path, kind)
    db = f"sqlite:///{tmp_path / 'store.db'}"
    common = ["submit", str(path), "--task", "summarize", "--model", str(tiny_models("llama")), "--db", db]
    assert main([*common, "--id-column", "doc_id", "--text-column", "body"]) == 0
    job_id = capsys.readouterr().out.strip()
    with JobStore.open(db) as store:
        assert [(item.custom_id, item.input) for item in store.job_items(job_id)] == [
            ("d1", "First body."), ("d2", "Second body.")]
    assert main([*common, "--id-column", "doc_id", "--text-column", "summary"]) != 0
    message = capsys.readouterr().err
    assert "no column --text-column 'summary'" in message and "doc_id, body, highlights" in message
