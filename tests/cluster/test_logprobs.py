"""logprobs and top_logprobs computed on the last of real stage processes from the model's own distribution, as
transformers computes them on the tiny model; `layerbus run` writes them into the Parquet and the output file."""

from __future__ import annotations

import json

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.broker.requests import GenerationRequest
from layerbus.jobs.logprobs import logprobs_json
from layerbus.wire.constraint import Constraint
from tests.helpers.batch_lines import CHAT, COMPLETIONS, line


def test_logprobs_match_transformers_on_the_tiny_model(tiny_models):
    """The chosen token's log-prob and the top 4 are the model's own distribution at each position, constrained
    item or not (a mask changes what is chosen, not what the model thought), as transformers computes them."""
    from tests.helpers.faulted_runs import run

    model_dir = tiny_models("llama", num_hidden_layers=4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(f"the stage {i} sends rows") for i in range(4)]
    requests = [GenerationRequest(f"r{i}", prompt, max_new_tokens=10, want_logprobs=True, top_logprobs=4,
                                  constraint=Constraint("regex", "[a-z ]{3,20}") if i % 2 else None)
                for i, prompt in enumerate(prompts)]
    results, _ = run(model_dir, requests, num_stages=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for request in requests:
        result = results[request.request_id]
        ids = torch.tensor([request.prompt_ids + result.token_ids])
        with torch.no_grad():
            reference = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(request.prompt_ids) - 1
        assert len(result.logprobs) == len(result.top_logprobs) == len(result.token_ids)
        for k, token in enumerate(result.token_ids):
            expected = reference[start + k]
            assert result.logprobs[k] == pytest.approx(float(expected[token]), abs=1e-4)
            values, top_ids = torch.topk(expected, 4)
            assert [i for i, _ in result.top_logprobs[k]] == top_ids.tolist()
            assert [lp for _, lp in result.top_logprobs[k]] == pytest.approx(values.tolist(), abs=1e-4)
            if request.constraint is None:
                assert token == top_ids[0], "greedy takes the top token"
        stored = json.loads(logprobs_json(result))
        assert [entry["token"] for entry in stored["content"]] == [tokenizer.decode([t]) for t in result.token_ids]


def test_layerbus_run_writes_logprobs_into_the_parquet_and_the_output_file(tiny_models, tmp_path):
    from layerbus.storage.results import read_results
    from tests.helpers.cli import JOB_ID, layerbus, status_json, write_jsonl

    scored_prompt = "the stage sends its rows to the next one"
    items = [json.loads(line(CHAT, logprobs=True, top_logprobs=2, max_tokens=6)),
             {**json.loads(line(COMPLETIONS, logprobs=1, max_tokens=6)), "custom_id": "b"},
             {**json.loads(line(CHAT, max_tokens=6)), "custom_id": "c"},
             {"custom_id": "d", "method": "POST", "url": COMPLETIONS,
              "body": {"prompt": scored_prompt, "max_tokens": 2, "prompt_logprobs": True}}]
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    model_dir = tiny_models("llama")
    ran = layerbus(home, "run", write_jsonl(tmp_path / "batch.jsonl", items), "--task", "generate", "--model",
                   model_dir, "--stages", "1", "--db", db, timeout=300)
    assert ran.returncode == 0, ran.stderr
    job_id = JOB_ID.search(ran.stdout).group()
    rows = {r["custom_id"]: r for r in read_results(status_json(home, job_id, "--db", db)["results_path"]).to_pylist()}
    assert rows["c"]["logprobs"] is None, "not asked for: null"
    chat_logprobs = json.loads(rows["a"]["logprobs"])["content"]
    assert len(chat_logprobs) == rows["a"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2
                                                                        for t in chat_logprobs)
    out = tmp_path / "out.jsonl"
    assert layerbus(home, "results", job_id, "--format", "openai", "--output", out, "--db", db).returncode == 0
    bodies = {json.loads(l)["custom_id"]: json.loads(l)["response"]["body"] for l in out.read_text().splitlines()}
    chat = ChatCompletion.model_validate(bodies["a"])
    assert [t.logprob for t in chat.choices[0].logprobs.content] == [t["logprob"] for t in chat_logprobs]
    text = Completion.model_validate(bodies["b"])
    assert len(text.choices[0].logprobs.tokens) == rows["b"]["completion_tokens"]
    assert all(len(top) == 1 for top in text.choices[0].logprobs.top_logprobs)
    assert bodies["c"]["choices"][0]["logprobs"] is None
    # The prompt's own log-probabilities, as transformers computes them (the prompt as the job tokenized it)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(scored_prompt).input_ids
    with torch.no_grad():
        reference = torch.log_softmax(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    expected = reference.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    prompt = json.loads(rows["d"]["logprobs"])["prompt"]
    assert prompt[0] is None and [t["token"] for t in prompt[1:]] == [tokenizer.decode([i]) for i in ids[1:]]
    assert [t["logprob"] for t in prompt[1:]] == pytest.approx(expected, abs=1e-4)
    assert bodies["d"]["prompt_logprobs"] == prompt and bodies["d"]["choices"][0]["logprobs"] is None
    assert rows["a"]["logprobs"] and "prompt" not in json.loads(rows["a"]["logprobs"]), "only where asked"
