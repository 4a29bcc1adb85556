"""Compressed wire codecs through real stage processes: mixed codecs per hop on a tiny model, the
CLI's --wire and its line in `layerbus status`, and (slow) greedy output on the default model with
a 16-bit wire equal to the float32 wire's, or differing only at proven near-ties."""

from __future__ import annotations

import re
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.broker.requests import GenerationRequest
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.placement import PlanOptions
from layerbus.wire.codecs import wire_bytes
from tests.helpers.cli import JOB_ID, layerbus, status_json, write_jsonl
from tests.helpers.equivalence import TINY_PROMPTS, assert_equivalent, top2_gap

# A lossy hop may flip a token where the float32 run's top two logits are this close (int8's error
# on the tiny model's logits is a few 1e-3); a broken codec flips them at gaps of whole logits.
INT8_TIE = 0.05


pytestmark = [pytest.mark.cluster,  # stage processes and `layerbus run`
              pytest.mark.filterwarnings("ignore:The given buffer is not writable")]


def run_with_wire(model_dir, num_stages: int, requests, wire, num_slots: int = 4, partition: str = "planned",
                  **batching):
    config = BrokerConfig(str(model_dir), num_stages, wire=wire, partition=partition,
                          plan_options=PlanOptions(allow_drop=False),
                          batching=BatchingConfig(num_slots=num_slots, **batching))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
        results, stats = cluster.broker.generate(requests)
        # A short run may end before a heartbeat brings each stage's final stats: wait for one.
        sent_before = {s.name: s.stats.get("steps", -1) for s in cluster.broker.chain}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(s.stats.get("steps", -1) == sent_before[s.name]
                                                  for s in cluster.broker.chain):
            cluster.broker.control.poll(100)
        stats.stage_stats = {s.name: dict(s.stats) for s in cluster.broker.chain}
        stats.chain = [s.name for s in cluster.broker.chain]  # the planner may order the stages its own way
        return results, stats, cluster.broker.link_codecs, cluster.broker.run_info()


def test_int8_and_float16_hops_through_real_stages(tiny_models):
    """3 stages, int8 on the first hop and float16 on the second: each receiver decodes what its
    header says; the bytes each stage sent show the codecs travelled; greedy tokens match
    transformers' float32 generate but where its top two logits are within INT8_TIE."""
    model_dir = tiny_models("llama", num_hidden_layers=4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    requests = [GenerationRequest(f"p{i}", tokenizer(p).input_ids, max_new_tokens=8) for i, p in enumerate(TINY_PROMPTS)]
    results, stats, codecs, info = run_with_wire(model_dir, 3, requests, ("int8", "float16"), max_step_tokens=16)
    assert codecs == ["int8", "float16"]
    assert [link["codec"] for link in info["wire"]] == ["int8", "float16"]
    assert stats.finished == len(requests) and all(r.error is None for r in results)
    assert assert_equivalent(model, requests, results, tie=INT8_TIE) >= len(requests) - 2
    sent = {name: s["bytes_out"] for name, s in stats.stage_stats.items()}
    received = {name: s["tokens"] for name, s in stats.stage_stats.items()}  # positions each stage ran
    hidden = model.config.hidden_size
    first, middle, last = stats.chain
    assert sent[first] == wire_bytes("int8", received[middle], hidden) < 0.36 * received[middle] * hidden * 4
    assert sent[middle] == wire_bytes("float16", received[last], hidden) == received[last] * hidden * 2
    assert all(s["codec_s"] > 0 for s in stats.stage_stats.values())


def test_cli_wire_option_and_status_line(tmp_path, tiny_models):
    home = tmp_path / "home"
    corpus = write_jsonl(tmp_path / "corpus.jsonl",
                         [{"id": f"doc-{i}", "text": f"Batch {i} goes down the chain."} for i in range(4)])
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    # --partition balanced: the planned partition may rightly leave one of two stages on one 2-core
    # host out of the chain (one stage is faster there), and this test is about the link between two.
    result = layerbus(home, "run", corpus, "--task", "summarize", "--model", tiny_models("llama"), "--stages", "2",
                      "--db", db, "--max-new-tokens", "4", "--max-context", "128", "--wire", "int8",
                      "--partition", "balanced", timeout=120)
    assert result.returncode == 0, result.stderr
    job_id = JOB_ID.search(result.stdout).group()
    # The planner orders the chain its own way: either stage may come first.
    assert re.search(r"\nchain +(stage-0 \[0, \d+\) -int8-> stage-1|stage-1 \[0, \d+\) -int8-> stage-0) \[\d+, \d+\)\n",
                     layerbus(home, "status", job_id, "--db", db).stdout)
    [link] = status_json(home, job_id, "--db", db)["wire"]
    assert {link["from"], link["to"]} == {"stage-0", "stage-1"} and link["codec"] == "int8"
    refused = layerbus(home, "run", corpus, "--task", "summarize", "--model", tiny_models("llama"), "--stages", "3",
                       "--db", db, "--wire", "int8,int4,float16")
    assert refused.returncode == 2 and "lists 3 codec(s)" in refused.stderr and "for 2 link(s)" in refused.stderr


# bfloat16 keeps 8 significant bits: its rounding moves SmolLM2's logits by up to about 1e-2, so a
# token may flip where float32's top two logits are that close. Such a flip counts as a proven
# near-tie only when the single-process model with the same rounding at the same cuts picks the
# pipeline's token there too (the flip is the codec's, not the pipeline's).
SIXTEEN_BIT_TIE = {"float16": 1e-4, "bfloat16": 2e-2}
CUTS = [13, 26]  # the balanced 3-stage plan of SmolLM2: [0, 13) [13, 26) [26, 30)


def top_token_with_codec(model, ids: list[int], codec: str, cuts: list[int]) -> int:
    """The next token of `ids` with the hidden states round-tripped through `codec` after each cut."""
    from layerbus.stages.wire_quality import round_trip

    def hook(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        rounded = round_trip(codec, hidden.reshape(-1, hidden.shape[-1])).to(hidden.dtype).reshape(hidden.shape)
        return (rounded, *output[1:]) if isinstance(output, tuple) else rounded

    handles = [model.model.layers[cut - 1].register_forward_hook(hook) for cut in cuts]
    try:
        with torch.no_grad():
            return int(model(torch.tensor([ids])).logits[0, -1].argmax())
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("codec", ["float16", "bfloat16"])
def test_default_model_16_bit_wire_matches_float32(smollm2_case, codec):
    """3 stages with a 16-bit wire on both hops: the same greedy tokens as transformers' float32
    `generate` on 10 sample-corpus summaries, except at proven near-ties."""
    model_dir, model, requests, references = smollm2_case
    # "balanced" places the cuts at CUTS, where top_token_with_codec rounds (no profiling to wait for).
    results, _, codecs, info = run_with_wire(model_dir, 3, requests, codec, partition="balanced", max_step_tokens=64)
    assert codecs == [codec, codec]
    assert [stage["layers"] for stage in info["stages"]] == ["[0, 13)", "[13, 26)", "[26, 30)"], info["stages"]
    exact = 0
    for request, result, expected in zip(requests, results, references):
        assert result.error is None
        got = result.token_ids
        if got == expected:
            exact += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        context = request.prompt_ids + expected[:first]
        gap = top2_gap(model, context)
        assert gap < SIXTEEN_BIT_TIE[codec], (f"{request.request_id}: token {first} differs at a float32 top-2 gap "
                                              f"of {gap:.2e}, not a near-tie for {codec}")
        assert top_token_with_codec(model, context, codec, CUTS) == got[first], (
            f"{request.request_id}: token {first} differs, and {codec} rounding alone does not explain it")
    assert exact >= len(requests) - 2
