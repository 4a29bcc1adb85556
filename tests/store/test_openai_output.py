"""The OpenAI Batch output and error lines of a job read back from a real store (a SQLite file, and a real
PostgreSQL database): completed, failed while running, refused at submit and cancelled items, each in its
file, in submission order, every custom_id exactly once, and the lines valid against OpenAI's shapes."""

from __future__ import annotations

import io
import json

import jsonschema
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from layerbus.jobs.item_params import item_params
from layerbus.jobs.runner import run_job
from layerbus.jobs.openai_output import (CANCELLED_CODE, FAILED_CODE, REFUSED_CODE, OutputJob, join_by_seq,
                                         output_line, write_openai_files)
from layerbus.storage import InvalidItem, ItemResult, JobSettings, JobStore, NewItem
from tests.helpers.fixtures_jobs import tokenizer  # noqa: F401 - fixture
from tests.helpers.fixtures_stores import store, store_url  # noqa: F401 - fixtures
from tests.helpers.openai_batch_schema import ERROR_LINE, OUTPUT_LINE, check_files
from tests.helpers.scripted_broker import FailingBroker, queue_job

SETTINGS = JobSettings(task="generate", model="tiny-model", max_new_tokens=8)
JOB = OutputJob(job_id="job_0123456789ab", model="tiny-model", created=1_900_000_000)


def queue(store: JobStore) -> str:
    """chat-1, text-2 and plain-3 (no endpoint: the simple form) complete; long-4 fails while running;
    bad-5 was refused at submit; later-6 stays queued until the job is cancelled."""
    endpoints = {"chat-1": "/v1/chat/completions", "text-2": "/v1/completions", "plain-3": None, "long-4": None,
                 "later-6": "/v1/chat/completions"}
    seqs = {"chat-1": 1, "text-2": 2, "plain-3": 3, "long-4": 4, "later-6": 6}
    items = [NewItem(cid, f"input of {cid}", f"prompt of {cid}", item_params({}, True, endpoint), seqs[cid])
             for cid, endpoint in endpoints.items()]
    return store.create_job(SETTINGS, items, [InvalidItem("bad-5", "{oops", "line 5: malformed JSON", seq=5)])


def run_four(store: JobStore, job_id: str) -> None:
    claimed = store.claim_items(job_id, "worker", limit=4)
    assert [c.custom_id for c in claimed] == ["chat-1", "text-2", "plain-3", "long-4"]
    results = [ItemResult(c.item_id, f"answer to {c.custom_id}", "stop" if i else "length", 5 + i, 3, 0.1)
               for i, c in enumerate(claimed[:3])]
    results.append(ItemResult(claimed[3].item_id, None, "error", 900, 0, 0.0, error="prompt is 900 tokens, over 128"))
    store.complete_items(results)
    store.cancel_job(job_id)


def lines_of(store: JobStore, job_id: str) -> tuple[str, str]:
    output, errors = io.StringIO(), io.StringIO()
    counts = write_openai_files(JOB, join_by_seq(store.item_results(job_id), store.job_items(job_id)), output, errors)
    assert (counts.output, counts.errors) == (3, 3)
    return output.getvalue(), errors.getvalue()


def test_each_item_lands_in_its_file_in_submission_order(store, tmp_path):
    job_id = queue(store)
    run_four(store, job_id)

    output, errors = lines_of(store, job_id)
    (tmp_path / "out.jsonl").write_text(output)
    (tmp_path / "err.jsonl").write_text(errors)
    done, failed = check_files(tmp_path / "out.jsonl", tmp_path / "err.jsonl")

    assert [line["custom_id"] for line in done] == ["chat-1", "text-2", "plain-3"]
    assert [line["custom_id"] for line in failed] == ["long-4", "bad-5", "later-6"]
    chat, text, plain = (line["response"]["body"] for line in done)
    assert (chat["object"], text["object"], plain["object"]) == ("chat.completion", "text_completion",
                                                                 "chat.completion")
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "answer to chat-1", "refusal": None}
    assert chat["choices"][0]["finish_reason"] == "length" and text["choices"][0]["finish_reason"] == "stop"
    assert text["choices"][0]["text"] == "answer to text-2"
    assert chat["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert chat["model"] == "tiny-model" and chat["created"] == JOB.created
    errors_by_id = {line["custom_id"]: line["error"] for line in failed}
    assert errors_by_id["long-4"] == {"code": FAILED_CODE, "message": "prompt is 900 tokens, over 128"}
    assert errors_by_id["bad-5"] == {"code": REFUSED_CODE, "message": "line 5: malformed JSON"}
    assert errors_by_id["later-6"]["code"] == CANCELLED_CODE


def test_the_bodies_round_trip_through_the_openai_package_types(store):
    # The output parses as the `openai` package's own response types, and dumps back
    # to the same JSON (a wrong literal, type or missing required field raises in model_validate).
    job_id = queue(store)
    run_four(store, job_id)
    output, _ = lines_of(store, job_id)
    bodies = [json.loads(line)["response"]["body"] for line in output.splitlines()]
    types = {"chat.completion": ChatCompletion, "text_completion": Completion}

    parsed = [types[body["object"]].model_validate(body) for body in bodies]

    assert [type(p) for p in parsed] == [ChatCompletion, Completion, ChatCompletion]
    assert [p.model_dump(mode="json", exclude_unset=True) for p in parsed] == bodies
    assert parsed[0].choices[0].message.content == "answer to chat-1" and parsed[0].usage.total_tokens == 8
    assert parsed[1].choices[0].text == "answer to text-2"


def test_the_files_are_the_same_bytes_when_written_again(store):
    job_id = queue(store)
    run_four(store, job_id)
    assert lines_of(store, job_id) == lines_of(store, job_id)


def test_the_schema_check_refuses_what_openai_would_not_write():
    row = {"custom_id": "a", "seq": 1, "status": "completed", "output": "hi", "finish_reason": "stop",
           "prompt_tokens": 2, "completion_tokens": 1, "prompt": "p"}
    _, line = output_line(JOB, row, {})
    jsonschema.validate(line, OUTPUT_LINE)
    broken = json.loads(json.dumps(line))
    broken["response"]["body"]["choices"][0]["finish_reason"] = "error"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, OUTPUT_LINE)
    del broken["response"]["body"]["usage"]["total_tokens"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, OUTPUT_LINE)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(line, ERROR_LINE)


def test_a_result_without_its_queued_item_is_named():
    class Item:
        seq, prompt, params = 1, "p", {}

    rows = [{"custom_id": "a", "seq": 1}, {"custom_id": "ghost", "seq": 7}]
    with pytest.raises(ValueError, match="'ghost' \\(seq 7\\)"):
        list(join_by_seq(rows, [Item()]))


def test_a_job_whose_every_item_failed_ends_failed_and_its_errors_are_all_in_the_error_file(store, tokenizer,
                                                                                            tmp_path):
    job_id = queue_job(store, 3, invalid=1)

    status = run_job(store, job_id, FailingBroker(tokenizer), tmp_path, poll_cancel_s=0)

    assert (status.status, status.failed, status.completed) == ("failed", 4, 0)
    assert status.error.startswith("every item failed (4 of 4)") and job_id in status.error
    output, errors = io.StringIO(), io.StringIO()
    counts = write_openai_files(JOB, join_by_seq(store.item_results(job_id), store.job_items(job_id)), output, errors)
    assert (counts.output, counts.errors, output.getvalue()) == (0, 4, "")
    failed = [json.loads(line) for line in errors.getvalue().splitlines()]
    assert [line["custom_id"] for line in failed] == ["doc-0", "doc-1", "doc-2", "bad-0"]
    assert [line["error"]["code"] for line in failed] == [FAILED_CODE] * 3 + [REFUSED_CODE]
    for line in failed:
        jsonschema.validate(line, ERROR_LINE)
