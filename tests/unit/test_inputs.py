"""Reading job inputs: every format parses, every bad input is refused with its line numbers, all at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerbus.jobs.inputs import load_inputs, read_inputs
from layerbus.jobs.item_checks import check_param
from layerbus.jobs.records import InputError, InputProblem, InputRecord

OPENAI_CHAT = {
    "custom_id": "c1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {
        "model": "any-model",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "The ferry leaves at noon."},
        ],
        "max_completion_tokens": 40,
        "temperature": 0.5,
        "stop": "\n\n",
    },
}
OPENAI_COMPLETION = {
    "custom_id": "p1",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"prompt": "Once upon a time", "max_tokens": 16, "top_p": 0.9, "top_k": 20, "seed": 3},
}


def write_jsonl(path: Path, *items: object) -> Path:
    """Each item is a dict (dumped as JSON) or a str (written verbatim as the line)."""
    lines = [item if isinstance(item, str) else json.dumps(item) for item in items]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def problem_lines(result) -> list[int]:
    return [p.line for p in result.problems]


# ---- JSONL: both forms parse ----


def test_simple_form_parses_with_params_and_integer_ids(tmp_path):
    path = write_jsonl(
        tmp_path / "in.jsonl",
        {"id": "a", "text": "First document."},
        "",  # a blank line holds no item and is not a problem
        {"id": 7, "text": "Second.", "max_tokens": 64, "temperature": 0, "stop": ["END"]},
        {"custom_id": "c", "text": "Third."},
    )
    result = load_inputs(path, "summarize", skip_invalid=False)
    assert result.problems == [] and result.invalid == []
    assert result.records == [
        InputRecord("a", "First document.", None, None, {}, str(path), 1),
        InputRecord("7", "Second.", None, None, {"max_tokens": 64, "temperature": 0.0, "stop": ["END"]}, str(path), 3),
        InputRecord("c", "Third.", None, None, {}, str(path), 4),
    ]


def test_simple_form_for_generate_takes_prompt_messages_or_text(tmp_path):
    messages = [{"role": "user", "content": "Hi"}]
    path = write_jsonl(
        tmp_path / "in.json",
        {"id": "p", "prompt": "Raw prompt"},
        {"id": "m", "messages": messages},
        {"id": "t", "text": "Text used as prompt"},
    )
    records = load_inputs(path, "generate", skip_invalid=False).records
    assert [(r.text, r.prompt, r.messages) for r in records] == [
        (None, "Raw prompt", None),
        (None, None, messages),
        (None, "Text used as prompt", None),
    ]


def test_openai_lines_for_generate(tmp_path):
    path = write_jsonl(tmp_path / "batch.jsonl", OPENAI_CHAT, OPENAI_COMPLETION)
    chat, completion = load_inputs(path, "generate", skip_invalid=False).records
    assert chat.custom_id == "c1" and chat.messages == OPENAI_CHAT["body"]["messages"] and chat.prompt is None
    # max_completion_tokens is OpenAI's newer name for max_tokens; a single stop string becomes a list.
    assert chat.params == {"max_tokens": 40, "temperature": 0.5, "stop": ["\n\n"]}
    assert completion.prompt == "Once upon a time" and completion.messages is None
    assert completion.params == {"max_tokens": 16, "top_p": 0.9, "top_k": 20, "seed": 3}
    # The model a line names travels with it, for submit to check against the job's (a job runs one model).
    assert (chat.model, completion.model) == ("any-model", None)


def test_openai_lines_for_summarize_use_the_last_user_message_or_the_prompt(tmp_path):
    path = write_jsonl(tmp_path / "batch.jsonl", OPENAI_CHAT, OPENAI_COMPLETION)
    chat, completion = load_inputs(path, "summarize", skip_invalid=False).records
    assert (chat.text, chat.messages, chat.prompt) == ("The ferry leaves at noon.", None, None)
    assert (completion.text, completion.prompt) == ("Once upon a time", None)


def test_openai_chat_line_ending_with_assistant_is_refused_for_translate(tmp_path):
    line = json.loads(json.dumps(OPENAI_CHAT))
    line["body"]["messages"].append({"role": "assistant", "content": "Noted."})
    result = read_inputs(write_jsonl(tmp_path / "b.jsonl", line), "translate")
    assert result.records == []
    assert "last message is from 'assistant'" in result.problems[0].message


# ---- JSONL: every bad line is refused, all at once ----

BAD_LINES = [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "expected a JSON object, got array"),
    ({"text": "no id here"}, "missing id"),
    ({"id": "", "text": "x"}, "id is blank"),
    ({"id": 1.5, "text": "x"}, "id must be a string or an integer, got number 1.5"),
    ({"id": "e"}, "missing text"),
    ({"id": "f", "text": "   "}, "text is empty"),
    ({"id": "g", "text": 42}, "text must be a string, got integer 42"),
    ({"id": "h", "text": "x", "temprature": 1}, "unknown key(s) 'temprature' (did you mean 'temperature'?)"),
    ({"id": "i", "text": "x", "max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ({"id": "j", "text": "x", "max_tokens": "64"}, "max_tokens must be a positive integer, got '64'"),
    ({"id": "k", "text": "x", "temperature": -0.1}, "temperature must be a number >= 0"),
    ({"id": "l", "text": "x", "top_p": 0}, "top_p must be a number in (0, 1]"),
    ({"id": "m", "text": "x", "top_p": 1.5}, "top_p must be a number in (0, 1]"),
    ({"id": "n", "text": "x", "stop": [1]}, "stop must be a non-empty string or an array of non-empty strings"),
    ({"id": "o", "text": "x", "seed": -1}, "seed must be an integer in [0, 2**63)"),
    ({"id": "p", "prompt": "raw"}, "prompt is a model prompt for --task generate"),
    ('{"id": "q", "text": "a", "text": "b"}', "key 'text' appears twice"),
    ({**OPENAI_CHAT, "custom_id": "r", "method": "GET"}, 'method must be "POST"'),
    ({**OPENAI_CHAT, "custom_id": "s", "url": "/v1/embeddings"}, "url '/v1/embeddings' is not supported"),
    ({"custom_id": "t", "method": "POST", "url": "/v1/completions"}, "missing body"),
    ({**OPENAI_CHAT, "custom_id": "t2", "url": ["/v1/completions"]}, "url ['/v1/completions'] is not supported"),
    ({**OPENAI_CHAT, "custom_id": "t3", "body": "text"}, "body must be an object, got string"),
    # n is honoured (samples per item); an unknown key is still refused, and so is an n out of range.
    ({**OPENAI_CHAT, "custom_id": "u", "body": {"messages": [], "tools": []}}, "unknown body key(s) 'tools'"),
    ({**OPENAI_CHAT, "custom_id": "u1", "body": {**OPENAI_CHAT["body"], "n": 129}},
     "body.n must be an integer from 1 to 128 (samples per item), got 129"),
    ({**OPENAI_CHAT, "custom_id": "u2", "body": {**OPENAI_CHAT["body"], "model": 4}},
     "body.model must be the model's name as a non-empty string, got 4"),
    ({**OPENAI_CHAT, "custom_id": "v", "body": {"prompt": "x"}}, "body.prompt does not belong on /v1/chat/completions"),
    ({**OPENAI_CHAT, "custom_id": "w", "extra": 1}, "unknown key(s) 'extra'; accepted: custom_id, method, url, body"),
    ({**OPENAI_CHAT, "custom_id": "x", "body": {"messages": [{"role": "robot", "content": "x"}]}},
     "body.messages[0].role must be one of system, user, assistant, got 'robot'"),
]


def test_every_bad_jsonl_line_is_reported_with_its_line_number(tmp_path):
    good = {"id": "good", "text": "A fine document."}
    path = write_jsonl(tmp_path / "in.jsonl", good, *(line for line, _ in BAD_LINES))
    result = read_inputs(path, "summarize")
    assert [r.custom_id for r in result.records] == ["good"]
    assert sorted(set(problem_lines(result))) == list(range(2, len(BAD_LINES) + 2))
    for number, (_, expected) in enumerate(BAD_LINES, start=2):
        messages = [p.message for p in result.problems if p.line == number]
        assert any(expected in m for m in messages), (number, expected, messages)
    with pytest.raises(InputError) as raised:
        load_inputs(path, "summarize", skip_invalid=False)
    text = str(raised.value).splitlines()
    for number in range(2, len(BAD_LINES) + 2):
        assert any(line.startswith(f"{path}:{number}: ") for line in text), number
    assert "--skip-invalid" in text[-1] and "1 valid item" in text[-1]
    assert len(text) == len(result.problems) + 1


def test_several_problems_on_one_line_are_all_listed(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", {"text": "", "max_tokens": -5, "colour": "red"})
    result = read_inputs(path, "summarize")
    messages = " | ".join(p.message for p in result.problems)
    for fragment in ("unknown key(s) 'colour'", "missing id", "text is empty", "max_tokens must be a positive"):
        assert fragment in messages
    assert result.invalid[0].error.count("; ") >= 3


def test_generate_refuses_two_kinds_of_content(tmp_path):
    both = {"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}
    path = write_jsonl(tmp_path / "in.jsonl", both)
    [problem] = read_inputs(path, "generate").problems
    assert "give one of text, prompt or messages, not messages and prompt" in problem.message


def test_duplicate_ids_name_both_lines_and_keep_the_first(tmp_path):
    path = write_jsonl(
        tmp_path / "in.jsonl",
        {"id": "a", "text": "one"},
        {"id": "b", "text": "two"},
        {"id": "a", "text": "three"},
    )
    result = load_inputs(path, "summarize", skip_invalid=True)
    assert [r.custom_id for r in result.records] == ["a", "b"]
    assert [str(p) for p in result.problems] == [f"{path}:3: duplicate id 'a': line 1 has it already"]
    # The refused duplicate gets a synthetic id, so failed items stay unique by id.
    assert result.invalid[0].custom_id == "line-3" and result.invalid[0].seq == 3


def test_synthetic_ids_never_collide_with_real_ones(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", {"id": "line-2", "text": "ok"}, "{broken")
    result = read_inputs(path, "summarize")
    assert result.invalid[0].custom_id == "line-2-2"


def test_skip_invalid_returns_valid_records_and_the_invalid_items(tmp_path):
    bad = '{"id": "b", "text": "x", "top_p": 2}'
    path = write_jsonl(tmp_path / "in.jsonl", {"id": "a", "text": "ok"}, bad, "nonsense")
    result = load_inputs(path, "summarize", skip_invalid=True)
    assert [r.custom_id for r in result.records] == ["a"]
    assert [(i.custom_id, i.input, i.seq) for i in result.invalid] == [("b", bad, 2), ("line-3", "nonsense", 3)]
    assert "top_p must be a number in (0, 1], got 2" in result.invalid[0].error


def test_invalid_utf8_on_one_line_refuses_only_that_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "\xff"}\n')
    result = read_inputs(path, "summarize")
    assert [r.custom_id for r in result.records] == ["a"]
    assert [str(p) for p in result.problems] == [f"{path}:2: not valid UTF-8: byte 0xff at column 22"]


def test_utf8_bom_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "ok"}\r\n{"id": "b", "text": "also"}\r\n')
    assert [r.text for r in load_inputs(path, "summarize", skip_invalid=False).records] == ["ok", "also"]


# ---- whole-file problems ----


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "missing.jsonl", "does not exist; accepted: a .jsonl"),
        (lambda d: write_jsonl(d / "empty.jsonl"), "file is empty"),
        (lambda d: (d / "blank.jsonl").write_text("\n  \n") and d / "blank.jsonl", "file is empty"),
        (lambda d: (d / "x.jsonl").mkdir() or d / "x.jsonl", "is a directory, but a .jsonl input must be a file"),
        (lambda d: (d / "notes.md").write_text("# hi") and d / "notes.md", "unknown input kind '.md'"),
        (lambda d: (d / "arr.json").write_text('[\n{"id": "a"}\n]') and d / "arr.json", "looks like one JSON array"),
    ],
)
def test_whole_file_problems_name_the_path_and_refuse_even_with_skip_invalid(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(InputError) as raised:
        load_inputs(path, "summarize", skip_invalid=True)
    [problem] = raised.value.problems
    assert problem.source == str(path) and problem.line == 0 and expected in problem.message
    assert str(raised.value).startswith(f"{path}: ")
    assert "--skip-invalid cannot help" in str(raised.value).splitlines()[-1]


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="choose --task summarize, translate, generate"):
        read_inputs(Path("whatever.jsonl"), "classify")


def test_input_error_lists_every_problem_then_the_way_out():
    problems = [InputProblem("a.jsonl", 2, "bad"), InputProblem("a.jsonl", 0, "worse")]
    assert str(InputError(problems, valid_count=3)).splitlines() == [
        "a.jsonl:2: bad",
        "a.jsonl: worse",
        "Fix the 2 problem(s) above, or pass --skip-invalid to queue the 3 valid item(s) "
        "and record the invalid ones as failed.",
    ]


# ---- parameters: one table for the rules every format shares ----


@pytest.mark.parametrize(
    "name, value, clean",
    [
        ("max_tokens", 1, 1),
        ("max_tokens", 128.0, 128),  # pandas writes int columns with gaps as floats
        ("top_k", 40, 40),
        ("seed", 0, 0),
        ("temperature", 0, 0.0),
        ("temperature", 1.3, 1.3),
        ("top_p", 1, 1.0),
        ("stop", "###", ["###"]),
        ("stop", ["a", "b"], ["a", "b"]),
    ],
)
def test_valid_params(name, value, clean):
    assert check_param(name, value, name) == (clean, None)


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 1.5), ("max_tokens", None),
        ("top_k", 0), ("seed", 2**63), ("seed", -3), ("temperature", float("nan")),
        ("temperature", "0.7"), ("top_p", 0.0), ("top_p", float("inf")), ("stop", ""), ("stop", ["ok", ""]),
        ("stop", {"a": 1}),
    ],
)
def test_invalid_params_name_the_key_and_value(name, value):
    clean, reason = check_param(name, value, f"body.{name}")
    assert clean is None and reason.startswith(f"body.{name} must be")


def test_nul_characters_are_refused_with_their_line(tmp_path):
    """PostgreSQL cannot store NUL in text: such items are refused at submit, not at insert."""
    from layerbus.jobs.inputs import read_inputs

    path = tmp_path / "nul.jsonl"
    path.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": "bad\\u0000text"}\n'
                    '{"id": "c\\u0000", "text": "x"}\n')
    result = read_inputs(path, "summarize")
    assert [r.custom_id for r in result.records] == ["a"]
    assert sorted(p.line for p in result.problems) == [2, 3]
    assert all("NUL character" in p.message for p in result.problems)
