"""`layerbus results JOB --format openai` from a real `layerbus run` (tiny random model, 2 stage processes, a
SQLite file): the output and error JSONL validate against OpenAI's shapes, every custom_id appears once
across the two; and a job whose every item failed ends failed, saying so, with its failures counted."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.fixtures_cli import home, tiny  # noqa: F401 - fixtures
from tests.helpers.openai_batch_schema import check_files
from tests.helpers.cli import JOB_ID, layerbus, status_json, write_jsonl

RUN_TIMEOUT_S = 180


def chat_line(custom_id: str, content: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 4}}


def run(home, tmp_path, tiny, items: list[dict | str], *extra: str):
    corpus = write_jsonl(tmp_path / "batch.jsonl", items)
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    result = layerbus(home, "run", corpus, "--task", "generate", "--model", tiny, "--stages", "2", "--db", db,
                      "--max-new-tokens", "6", "--max-context", "96", "--slots", "4", *extra,
                      timeout=RUN_TIMEOUT_S)
    found = JOB_ID.search(result.stdout + result.stderr)
    assert found, f"no job id in the run's output:\n{result.stdout}\n{result.stderr}"
    return result, found.group(), db


def test_openai_files_of_a_finished_job(home, tmp_path, tiny):
    items = [chat_line(f"chat-{i}", f"Name a colour, number {i}.") for i in range(3)] + [
        {"custom_id": "text-0", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The stage sends", "max_tokens": 3}},
        chat_line("too-long", "word " * 150),  # over --max-context: fails while running
        {"custom_id": "refused", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "n": 0}},  # refused at submit (n is 1 to 128)
    ]
    result, job_id, db = run(home, tmp_path, tiny, items, "--skip-invalid")
    assert result.returncode == 0, result.stderr
    output, errors = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"

    written = layerbus(home, "results", job_id, "--format", "openai", "--output", output, "--errors", errors,
                       "--db", db)

    assert written.returncode == 0, written.stderr
    assert "4 completed item(s)" in written.stderr and "2 failed or cancelled item(s)" in written.stderr
    done, failed = check_files(output, errors)
    assert [line["custom_id"] for line in done] == ["chat-0", "chat-1", "chat-2", "text-0"]
    assert [line["custom_id"] for line in failed] == ["too-long", "refused"]
    assert {line["response"]["body"]["object"] for line in done[:3]} == {"chat.completion"}
    assert done[3]["response"]["body"]["object"] == "text_completion"
    assert all(1 <= line["response"]["body"]["usage"]["completion_tokens"] <= 4 for line in done)
    assert {line["response"]["body"]["model"] for line in done} == {Path(tiny).name}, "the name, not a local path"
    errors_by_id = {line["custom_id"]: line["error"] for line in failed}
    assert "context" in errors_by_id["too-long"]["message"]
    assert "body.n must be an integer from 1 to 128" in errors_by_id["refused"]["message"]

    to_stdout = layerbus(home, "results", job_id, "--format", "openai", "--db", db)
    assert to_stdout.returncode == 0 and to_stdout.stdout == output.read_text(), "the same lines, to stdout"
    assert "not written: give --errors FILE" in to_stdout.stderr
    plain = layerbus(home, "results", job_id, "--db", db)
    assert plain.returncode == 0 and plain.stdout.strip().endswith(".parquet"), "without --format: the path"
    misused = layerbus(home, "results", job_id, "--errors", errors, "--db", db)
    assert misused.returncode == 2 and "--format openai" in misused.stderr
    one_file = layerbus(home, "results", job_id, "--format", "openai", "--output", output, "--errors", output,
                        "--db", db)
    assert one_file.returncode == 2 and "a file of their own" in one_file.stderr
    assert check_files(output, errors)[0] == done, "a refused command leaves the files as they were"


def test_a_job_whose_every_item_failed_ends_failed(home, tmp_path, tiny):
    items = [chat_line(f"long-{i}", "word " * 150) for i in range(3)]

    result, job_id, db = run(home, tmp_path, tiny, items)

    assert result.returncode != 0, "a failed job is not a success"
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "failed" and "every item failed (3 of 3)" in status["error"]
    assert status["request_counts"]["failed"] == 3
    shown = layerbus(home, "status", job_id, "--db", db)
    assert "3 failed" in shown.stdout and "every item failed" in shown.stdout
    output, errors = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"
    written = layerbus(home, "results", job_id, "--format", "openai", "--output", output, "--errors", errors,
                       "--db", db)
    assert written.returncode == 0, written.stderr
    done, failed = check_files(output, errors)
    assert done == [] and [line["custom_id"] for line in failed] == ["long-0", "long-1", "long-2"]
