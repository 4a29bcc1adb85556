"""CSV and Parquet inputs: the columns they may have, row line numbers, and every bad row reported at once."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layerbus.jobs.inputs import load_inputs, read_inputs
from layerbus.jobs.records import InputError


def write_csv(tmp_path, text: str, name: str = "in.csv", bom: bool = False):
    path = tmp_path / name
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


# ---- CSV ----


def test_csv_parses_with_bom_quoted_newlines_and_params(tmp_path):
    path = write_csv(
        tmp_path,
        'id,text,max_tokens,temperature\r\n'
        'a,"First line\r\nsecond line, with a comma",64,0.2\r\n'
        '\r\n'
        'b,Plain,,\r\n',
        bom=True,
    )
    a, b = load_inputs(path, "summarize", skip_invalid=False).records
    assert (a.custom_id, a.text, a.params, a.line) == ("a", "First line\r\nsecond line, with a comma",
                                                       {"max_tokens": 64, "temperature": 0.2}, 2)
    # Row b starts on line 5: the quoted newline and the blank line both count, as an editor shows them.
    assert (b.custom_id, b.text, b.params, b.line) == ("b", "Plain", {}, 5)


def test_csv_prompt_column_and_custom_id_for_generate(tmp_path):
    path = write_csv(tmp_path, "custom_id,prompt,top_k,seed\nq1,Once upon a time,50,9\n")
    [record] = load_inputs(path, "generate", skip_invalid=False).records
    assert (record.custom_id, record.prompt, record.params) == ("q1", "Once upon a time", {"top_k": 50, "seed": 9})


def test_every_bad_csv_row_is_reported_with_the_line_it_starts_on(tmp_path):
    path = write_csv(
        tmp_path,
        "id,text,max_tokens,top_p\n"
        "ok,Fine text,,\n"        # line 2: valid
        ",No id,,\n"              # line 3
        "c,,,\n"                  # line 4: no text
        "d,Text,lots,\n"          # line 5
        'e,"Multi\nline",,1.5\n'  # line 6 (ends on 7)
        "f,Too,many,fields,here\n"  # line 8
        "ok,Duplicate,,\n",       # line 9
    )
    result = read_inputs(path, "summarize")
    assert [r.custom_id for r in result.records] == ["ok"]
    assert [str(p) for p in result.problems] == [
        f"{path}:3: missing id: every item needs one so its result can be found in the output",
        f"{path}:4: missing text: give the document",
        f"{path}:5: max_tokens must be a positive integer, got 'lots'",
        f"{path}:6: top_p must be a number in (0, 1], got 1.5",
        f"{path}:8: row has 5 field(s) but the header has 4; quote any text that holds a comma",
        f"{path}:9: duplicate id 'ok': line 2 has it already",
    ]
    assert result.invalid[3].input == 'e,"Multi\nline",,1.5'
    assert [i.custom_id for i in result.invalid] == ["line-3", "c", "d", "e", "line-8", "line-9"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", "file is empty: a CSV input needs a header line"),
        ("id,text\n", "no items: the file has a header line but no rows"),
        ("id,text,colour\na,b,c\n", "unknown column(s) 'colour'; accepted: id, custom_id, text, prompt, max_tokens"),
        ("id,text,temprature\na,b,1\n", "'temprature' (did you mean 'temperature'?)"),
        ("doc-1,Some text\n", "the first line must be a header naming the columns, such as id,text"),
        ("text,max_tokens\nhello,5\n", "no id column"),
        ("id,max_tokens\na,5\n", "no content column"),
        ("id,custom_id,text\na,b,c\n", "not both"),
        ("id,text,text\na,b,c\n", "column(s) text appear more than once"),
        ("id,text,\na,b,\n", "column 3 has no name"),
        ('id,text\na,"unclosed\n', "cannot parse as CSV"),
    ],
)
def test_whole_csv_problems_refuse_every_row(tmp_path, text, expected):
    path = write_csv(tmp_path, text)
    result = read_inputs(path, "summarize")
    assert result.records == []
    assert any(expected in p.message for p in result.problems), [p.message for p in result.problems]
    with pytest.raises(InputError, match="--skip-invalid cannot help"):
        load_inputs(path, "summarize", skip_invalid=True)


def test_undecodable_csv_names_the_line_of_the_bad_byte(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes(b"id,text\na,fine\nb,caf\xe9\n")
    [problem] = read_inputs(path, "summarize").problems
    assert str(problem) == f"{path}: not valid UTF-8: byte 0xe9 on line 3; save the file as UTF-8"


# ---- Parquet ----


def write_parquet(tmp_path, columns: dict, name: str = "in.parquet"):
    path = tmp_path / name
    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_parses_with_integer_ids_and_nulls_as_not_given(tmp_path):
    path = write_parquet(tmp_path, {
        "id": [10, 11],
        "text": ["Doc ten.", "Doc eleven."],
        "max_tokens": pa.array([32, None], pa.int64()),
        "temperature": pa.array([None, 0.0], pa.float64()),
    })
    first, second = load_inputs(path, "translate", skip_invalid=False).records
    assert (first.custom_id, first.text, first.params, first.line) == ("10", "Doc ten.", {"max_tokens": 32}, 1)
    assert (second.custom_id, second.params, second.line) == ("11", {"temperature": 0.0}, 2)


def test_every_bad_parquet_row_is_reported_with_its_row_number(tmp_path):
    path = write_parquet(tmp_path, {
        "custom_id": ["a", None, "c", "a"],
        "text": ["ok", "no id", None, "dup"],
        "top_p": pa.array([None, None, 0.0, None], pa.float64()),
    })
    result = read_inputs(path, "summarize")
    assert [r.custom_id for r in result.records] == ["a"]
    assert [(p.line, p.message.split(":")[0]) for p in result.problems] == [
        (2, "missing custom_id"), (3, "missing text"), (3, "top_p must be a number in (0, 1], got 0.0"),
        (4, "duplicate id 'a'"),
    ]
    assert [i.custom_id for i in result.invalid] == ["row-2", "c", "row-4"]


@pytest.mark.parametrize(
    "columns, expected",
    [
        ({"id": ["a"], "title": ["x"], "summary": ["y"]}, "no content column"),
        ({"id": ["a"], "text": ["x"], "colour": ["red"]}, "unknown column(s) 'colour'"),
        ({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}, "no items: the table has no rows"),
    ],
)
def test_whole_parquet_problems(tmp_path, columns, expected):
    result = read_inputs(write_parquet(tmp_path, columns), "summarize")
    assert result.records == []
    assert any(expected in p.message for p in result.problems), [p.message for p in result.problems]


def test_a_file_that_is_not_parquet_is_refused(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet at all")
    [problem] = read_inputs(path, "summarize").problems
    assert problem.line == 0 and problem.message.startswith("cannot read as Parquet:")
