"""logprobs and top_logprobs: asked per item on a batch line, kept in the store and the Parquet as OpenAI's
choice.logprobs, and written into the output file in each endpoint's form, without processes.
tests/cluster/test_logprobs.py computes them on real stages and checks them against transformers."""

from __future__ import annotations

import io
import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from layerbus.broker.requests import GenerationResult
from layerbus.jobs.item_params import item_params
from layerbus.jobs.jsonl_items import parse_jsonl_line
from layerbus.jobs.logprobs import completions_logprobs, logprobs_json
from layerbus.jobs.openai_output import OutputJob, join_by_seq, write_openai_files
from layerbus.storage import ItemResult, JobSettings, JobStore, NewItem
from tests.helpers.batch_lines import CHAT, COMPLETIONS, line


@pytest.mark.parametrize("url, body, params", [
    (CHAT, {"logprobs": True, "top_logprobs": 3}, {"logprobs": True, "top_logprobs": 3}),
    (CHAT, {"logprobs": True}, {"logprobs": True, "top_logprobs": 0}),
    (CHAT, {"logprobs": False}, {}),
    (COMPLETIONS, {"logprobs": 2}, {"logprobs": True, "top_logprobs": 2}),
    (COMPLETIONS, {"logprobs": 0}, {"logprobs": True, "top_logprobs": 0}),
])
def test_batch_lines_ask_for_logprobs_in_their_endpoints_form(url, body, params):
    outcome = parse_jsonl_line(line(url, **body), "generate", "in.jsonl", 1)
    assert outcome.problems == []
    assert {k: v for k, v in outcome.record.params.items() if k in ("logprobs", "top_logprobs")} == params


@pytest.mark.parametrize("url, body, words", [
    (CHAT, {"logprobs": 3}, "logprobs must be true or false"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "from 0 to 20"),
    (CHAT, {"top_logprobs": 2}, "needs body.logprobs: true"),
    (COMPLETIONS, {"logprobs": 6}, "from 0 to 5"),
    (COMPLETIONS, {"logprobs": 1, "top_logprobs": 1}, "top_logprobs is for /v1/chat/completions"),
])
def test_bad_logprob_requests_are_refused_with_their_line(url, body, words):
    outcome = parse_jsonl_line(line(url, **body), "generate", "in.jsonl", 4)
    assert outcome.record is None and len(outcome.problems) == 1
    assert str(outcome.problems[0]).startswith("in.jsonl:4: body.") and words in str(outcome.problems[0])


@pytest.mark.parametrize("url, body, params", [
    (CHAT, {"prompt_logprobs": True}, {"prompt_logprobs": True}),
    (COMPLETIONS, {"prompt_logprobs": 0}, {"prompt_logprobs": True}),
    (CHAT, {"prompt_logprobs": False}, {}),
    (CHAT, {"prompt_logprobs": True, "logprobs": True}, {"prompt_logprobs": True, "logprobs": True, "top_logprobs": 0}),
])
def test_batch_lines_ask_for_the_prompts_logprobs(url, body, params):
    outcome = parse_jsonl_line(line(url, **body), "generate", "in.jsonl", 1)
    assert outcome.problems == []
    assert {k: v for k, v in outcome.record.params.items() if "logprobs" in k} == params


@pytest.mark.parametrize("value, words", [
    (2, "body.prompt_logprobs 2: the prompt's alternatives are not computed"),
    ("yes", "body.prompt_logprobs must be true, false or 0, got 'yes'"),
    (None, "body.prompt_logprobs must be true, false or 0, got None"),
])
def test_bad_prompt_logprob_requests_are_refused_with_their_line(value, words):
    outcome = parse_jsonl_line(line(CHAT, prompt_logprobs=value), "generate", "in.jsonl", 5)
    assert outcome.record is None and len(outcome.problems) == 1
    assert str(outcome.problems[0]).startswith(f"in.jsonl:5: {words}")


def test_a_simple_line_asks_for_the_prompts_logprobs_too():
    outcome = parse_jsonl_line(json.dumps({"id": "a", "prompt": "hi", "prompt_logprobs": True}), "generate", "in.jsonl", 1)
    assert outcome.problems == [] and outcome.record.params["prompt_logprobs"] is True


def sample_result() -> GenerationResult:
    return GenerationResult("r", [11, 12], "stop", 3, logprobs=[-0.5, -1.25],
                            top_logprobs=[[(11, -0.5), (13, -1.0)], [(12, -1.25), (11, -2.0)]],
                            token_texts={11: "Hé", 12: " there", 13: "x"})


def test_the_stored_form_is_openais_chat_logprobs_and_rewrites_into_the_completions_form():
    stored = json.loads(logprobs_json(sample_result()))
    assert stored["content"][0] == {"token": "Hé", "logprob": -0.5, "bytes": list("Hé".encode()),
                                    "top_logprobs": [{"token": "Hé", "logprob": -0.5, "bytes": list("Hé".encode())},
                                                     {"token": "x", "logprob": -1.0, "bytes": [120]}]}
    assert completions_logprobs(stored) == {"tokens": ["Hé", " there"], "token_logprobs": [-0.5, -1.25],
                                            "top_logprobs": [{"Hé": -0.5, "x": -1.0}, {" there": -1.25, "Hé": -2.0}],
                                            "text_offset": [0, 2]}
    assert logprobs_json(GenerationResult("r", [1], "stop", 3)) is None, "not asked for: nothing stored"


def test_the_prompts_logprobs_are_stored_beside_the_outputs_and_written_where_vllm_puts_them(tmp_path):
    scored = GenerationResult("r", [11], "stop", 3, prompt_logprobs=[-2.0, -0.75], prompt_ids=[1, 13, 12],
                              token_texts={1: "<s>", 11: "Hé", 12: " there", 13: "x"})
    stored = json.loads(logprobs_json(scored))
    assert stored == {"content": None, "refusal": None,
                      "prompt": [None, {"token": "x", "logprob": -2.0, "bytes": [120]},
                                 {"token": " there", "logprob": -0.75, "bytes": list(b" there")}]}
    both = json.loads(logprobs_json(GenerationResult(**{**vars(sample_result()), "prompt_logprobs": [-1.0],
                                                        "prompt_ids": [13, 11]})))
    assert len(both["content"]) == 2 and both["prompt"] == [None, {"token": "Hé", "logprob": -1.0,
                                                                     "bytes": list("Hé".encode())}]
    with JobStore.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        items = [NewItem(cid, "in", "prompt", {**item_params({}, True, url), "prompt_logprobs": True}, seq)
                 for seq, (cid, url) in enumerate((("chat", CHAT), ("text", COMPLETIONS)), 1)]
        job_id = store.create_job(JobSettings(task="generate", model="tiny"), items, [])
        claimed = store.claim_items(job_id, "w", 2)
        store.complete_items([ItemResult(c.item_id, "Hé", "stop", 3, 1, 0.1, logprobs=logprobs_json(scored))
                              for c in claimed])
        output = io.StringIO()
        write_openai_files(OutputJob(job_id, "tiny", 1_900_000_000),
                           join_by_seq(store.item_results(job_id), store.job_items(job_id)), output, io.StringIO())
    chat, text = (json.loads(l)["response"]["body"] for l in output.getvalue().splitlines())
    for body in (chat, text):
        assert body["prompt_logprobs"] == stored["prompt"] and body["choices"][0]["logprobs"] is None
    assert ChatCompletion.model_validate(chat).choices[0].logprobs is None
    assert Completion.model_validate(text).choices[0].logprobs is None


def test_the_output_file_carries_them_and_parses_as_openais_types(tmp_path):
    with JobStore.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        items = [NewItem(cid, "in", "prompt", {**item_params({}, True, url), "logprobs": True, "top_logprobs": 2},
                         seq) for seq, (cid, url) in enumerate((("chat", CHAT), ("text", COMPLETIONS)), 1)]
        job_id = store.create_job(JobSettings(task="generate", model="tiny"), items, [])
        claimed = store.claim_items(job_id, "w", 2)
        stored = logprobs_json(sample_result())
        store.complete_items([ItemResult(c.item_id, "Hé there", "stop", 3, 2, 0.1, logprobs=stored) for c in claimed])
        assert [row["logprobs"] for row in store.item_results(job_id)] == [stored, stored]
        output = io.StringIO()
        write_openai_files(OutputJob(job_id, "tiny", 1_900_000_000),
                           join_by_seq(store.item_results(job_id), store.job_items(job_id)), output, io.StringIO())
    chat, text = (json.loads(l)["response"]["body"] for l in output.getvalue().splitlines())
    parsed_chat, parsed_text = ChatCompletion.model_validate(chat), Completion.model_validate(text)
    assert [t.logprob for t in parsed_chat.choices[0].logprobs.content] == [-0.5, -1.25]
    assert [t.token for t in parsed_chat.choices[0].logprobs.content[1].top_logprobs] == [" there", "Hé"]
    assert parsed_text.choices[0].logprobs.token_logprobs == [-0.5, -1.25]
    assert parsed_chat.model_dump(mode="json", exclude_unset=True) == chat
