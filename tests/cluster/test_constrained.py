"""Constrained decoding through real stage processes: every constrained item that finishes with "stop" matches
its constraint (jsonschema for schemas), and a kill -9 of the middle stage changes no output, on the tiny model
and on the default model's extraction job; `layerbus run` constrains per item and per job into the results."""

from __future__ import annotations

import json
import re

import jsonschema
from transformers import AutoTokenizer

from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig
from tests.helpers.constrained_items import PERSON, REGEX, check_output, extraction_items, mixed_requests
from tests.helpers.fixtures_cli import tiny  # noqa: F401 - fixture


def test_constrained_outputs_match_and_survive_a_kill_9_of_the_middle_stage(tiny_models):
    from tests.helpers.faulted_runs import kill_middle_after, run

    model_dir = tiny_models("llama", num_hidden_layers=6)
    requests, constraint_by_id = mixed_requests(model_dir, 18, max_new_tokens=40)
    unfaulted, _ = run(model_dir, requests)
    killed: list[str] = []
    kill_middle = kill_middle_after(4, killed)

    faulted, stats = run(model_dir, requests, on_result=kill_middle)
    assert killed and len(stats.recoveries) == 1
    for rid, result in unfaulted.items():
        assert result.error is None, result.error
        if result.finish_reason == "stop":
            check_output(constraint_by_id[rid], result.text)
    assert {r: v.token_ids for r, v in faulted.items()} == {r: v.token_ids for r, v in unfaulted.items()}
    assert {r: v.text for r, v in faulted.items()} == {r: v.text for r, v in unfaulted.items()}


def test_default_model_extraction_job_matches_every_constraint_and_survives_a_kill_9(default_model):
    from tests.helpers.faulted_runs import kill_middle_after, run

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    items = extraction_items(200)
    requests = [GenerationRequest(f"r{i}", tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                          add_generation_prompt=True, tokenize=True,
                                                                          return_dict=False),
                                  max_new_tokens=48, constraint=constraint)
                for i, (text, constraint) in enumerate(items)]
    # Two micro-batches of 32 rows: the same outputs (greedy) in fewer, fuller steps than 4 of 8 (115 s alone
    # before, 94 s now); the kill after 60 results still lands with 140 items to go.
    batching = BatchingConfig(num_slots=64, num_micro_batches=2, max_step_tokens=512)
    unfaulted, _ = run(default_model, requests, batching=batching)
    stopped = {kind: 0 for kind in ("json_schema", "choice", "regex")}
    for i, (_, constraint) in enumerate(items):
        result = unfaulted[f"r{i}"]
        assert result.error is None, result.error
        if result.finish_reason == "stop":
            check_output(constraint, result.text)
            stopped[constraint.kind] += 1
    assert all(count >= 20 for count in stopped.values()), f"too few items finished to check: {stopped}"
    killed: list[str] = []
    kill_middle = kill_middle_after(60, killed)

    faulted, stats = run(default_model, requests, batching=batching, on_result=kill_middle)
    assert killed and len(stats.recoveries) == 1
    assert {r: (v.token_ids, v.text) for r, v in faulted.items()} == {r: (v.token_ids, v.text)
                                                                      for r, v in unfaulted.items()}


def test_layerbus_run_constrains_per_item_and_per_job_into_the_results(tiny, tmp_path):
    """The whole path: batch lines' response_format / guided_* and --choices through the store, the job runner
    and the broker, into the Parquet and the OpenAI output file."""
    from layerbus.storage.results import read_results
    from tests.helpers.cli import JOB_ID, layerbus, status_json, write_jsonl

    def line(custom_id: str, **extra) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": f"Item {custom_id}, answer please."}], **extra}}

    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    items = [line("schema", response_format=schema), line("regex", guided_regex=REGEX), line("plain")]
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    corpus = write_jsonl(tmp_path / "batch.jsonl", items)
    ran = layerbus(home, "run", corpus, "--task", "generate", "--model", tiny, "--stages", "1", "--db", db,
                   "--max-new-tokens", "40", "--choices", "yes,no,maybe", timeout=300)
    assert ran.returncode == 0, ran.stderr
    job_id = JOB_ID.search(ran.stdout).group()
    rows = {r["custom_id"]: r for r in read_results(status_json(home, job_id, "--db", db)["results_path"]).to_pylist()}
    assert rows["plain"]["output"] in ("yes", "no", "maybe"), "the job's --choices holds where the item gives none"
    assert re.fullmatch(REGEX, rows["regex"]["output"]), "an item's own constraint wins over the job's"
    if rows["schema"]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(rows["schema"]["output"]), PERSON)
    else:
        assert rows["schema"]["output"].startswith("{")
    out = tmp_path / "out.jsonl"
    assert layerbus(home, "results", job_id, "--format", "openai", "--output", out, "--db", db).returncode == 0
    contents = {json.loads(l)["custom_id"]: json.loads(l)["response"]["body"]["choices"][0]["message"]["content"]
                for l in out.read_text().splitlines()}
    assert contents == {custom_id: row["output"] for custom_id, row in rows.items()}
