"""Directory inputs (one .txt file per item) and the sample corpus shipped in examples/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerbus.jobs.inputs import load_inputs, read_inputs
from layerbus.jobs.records import InputError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def make_dir(tmp_path, files: dict[str, bytes | str]) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, content in files.items():
        data = content.encode("utf-8") if isinstance(content, str) else content
        (folder / name).write_bytes(data)
    return folder


def test_each_txt_file_is_an_item_numbered_in_sorted_order(tmp_path):
    folder = make_dir(tmp_path, {"b.txt": "Second.\n", "a.txt": "First.\r\n", ".DS_Store": b"\x00\x01"})
    a, b = load_inputs(folder, "summarize", skip_invalid=False).records
    assert (a.custom_id, a.text, a.line, a.source) == ("a", "First.", 1, str(folder / "a.txt"))
    assert (b.custom_id, b.text, b.line) == ("b", "Second.", 2)


def test_txt_files_become_prompts_for_generate(tmp_path):
    folder = make_dir(tmp_path, {"p.txt": "Write a poem about rain."})
    [record] = load_inputs(folder, "generate", skip_invalid=False).records
    assert (record.prompt, record.text) == ("Write a poem about rain.", None)


def test_every_bad_file_is_reported_by_name(tmp_path):
    folder = make_dir(tmp_path, {
        "good.txt": "Fine.",
        "empty.txt": "  \n",
        "latin1.txt": b"caf\xe9",
        "notes.md": "# not read",
        "same.TXT": "Another file named same.",
        "same.txt": "A file named same.",
    })
    (folder / "nested").mkdir()
    result = read_inputs(folder, "summarize")
    assert [r.custom_id for r in result.records] == ["good", "same"]
    assert [str(p) for p in result.problems] == [
        f"{folder}/empty.txt: file is empty",
        f"{folder}/latin1.txt: not valid UTF-8: byte 0xe9 on line 1; save the file as UTF-8",
        f"{folder}/nested: subdirectory: only .txt files directly inside are read",
        f"{folder}/notes.md: not a .txt file: move it out, or rename it if it is text",
        f"{folder}/same.txt: duplicate id 'same': file same.TXT has it already",
    ]
    # Only .txt files are items: the .md file and the subdirectory are problems, not failed items.
    assert [(i.custom_id, i.seq) for i in result.invalid] == [("empty", 1), ("latin1", 3), ("file-5", 5)]
    assert result.invalid[1].input == "caf\ufffd"
    with pytest.raises(InputError) as raised:
        load_inputs(folder, "summarize", skip_invalid=False)
    assert "queue the 2 valid item(s)" in str(raised.value).splitlines()[-1]


@pytest.mark.parametrize(
    "files, expected",
    [({}, "directory is empty"), ({"readme.md": "x"}, "no .txt files in this directory")],
)
def test_a_directory_without_txt_files_is_refused(tmp_path, files, expected):
    folder = make_dir(tmp_path, files)
    with pytest.raises(InputError) as raised:
        load_inputs(folder, "summarize", skip_invalid=True)
    assert any(expected in p.message for p in raised.value.problems)


# ---- the sample corpus ----


def paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if p.strip()]


def test_sample_corpus_directory_has_40_documents_of_1_to_8_paragraphs():
    records = load_inputs(EXAMPLES / "sample_corpus", "summarize", skip_invalid=False).records
    assert len(records) == 40
    counts = [len(paragraphs(r.text)) for r in records]
    assert all(1 <= n <= 8 for n in counts)
    # A benchmark composes prompts of a chosen length from these: every length must be there.
    assert set(counts) == set(range(1, 9))
    assert all(r.custom_id.startswith(f"doc-{i:03d}-") for i, r in enumerate(records, start=1))


def test_sample_corpus_jsonl_holds_the_same_documents():
    from_dir = load_inputs(EXAMPLES / "sample_corpus", "summarize", skip_invalid=False).records
    from_jsonl = load_inputs(EXAMPLES / "sample_corpus.jsonl", "summarize", skip_invalid=False).records
    assert [(r.custom_id, r.text) for r in from_jsonl] == [(r.custom_id, r.text) for r in from_dir]


def test_openai_batch_example_parses_for_generate():
    path = EXAMPLES / "openai_batch_example.jsonl"
    records = load_inputs(path, "generate", skip_invalid=False).records
    assert len(records) == len(path.read_text().splitlines()) >= 3
    assert all(r.messages and r.prompt is None for r in records)
    assert all(json.loads(line)["url"] == "/v1/chat/completions" for line in path.read_text().splitlines())


def test_sample_corpus_stays_small():
    files = [*(EXAMPLES / "sample_corpus").iterdir(), EXAMPLES / "sample_corpus.jsonl"]
    assert sum(f.stat().st_size for f in files) < 150_000
