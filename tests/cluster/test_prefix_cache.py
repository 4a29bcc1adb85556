"""The prefix cache on real stages over real sockets: prompts that share a long prefix generate token for token
what `transformers` generates, with the cache on and off; eval contexts sharing examples score as a full pass;
a tiny budget evicts without the stages ever holding more than it; the next job restores what the last saved;
a kill -9 of a stage mid-job changes no output."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions
from layerbus.planner.prefix_budget import PrefixCacheConfig
from layerbus.broker.requests import GenerationRequest, ScoreRequest, ScoreSegment
from layerbus.planner.batching import BatchingConfig
from tests.helpers.equivalence import assert_equivalent, run_pipeline


def run_and_read_stages(model_dir, num_stages: int, requests, **batching):
    """Results, run stats and each stage's stats from a heartbeat sent after the run (the figures a
    stage reports ride on its heartbeats, every 0.5 s)."""
    import time

    config = BrokerConfig(str(model_dir), num_stages, batching=BatchingConfig(**batching))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=1)) as cluster:
        results, stats = cluster.broker.generate(requests)
        # Until each stage's step count has held still over a heartbeat (the figures of its last step have
        # arrived) and its prefix figures are there. (Waiting for the count to differ from the one seen at
        # the end of the run, as this did, waited out the whole deadline whenever the last heartbeat of the
        # run was already final: 30 s per run.)
        def reported():
            return {stage.name: stage.stats.get("steps") for stage in cluster.broker.chain}

        before, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline:
            cluster.broker.keep_alive(0.6)
            now = reported()
            if now == before and all("prefix_tokens_peak" in stage.stats for stage in cluster.broker.chain):
                break
            before = now
        cluster.broker.keep_alive(0.6)  # one heartbeat more
        stages = {stage.name: dict(stage.stats) for stage in cluster.broker.chain}
    return results, stats, stages


SYSTEM = ("You are a careful assistant. Summarize the document below in one sentence, keeping every name "
          "and number exactly as written, and answer in plain text. Document: ")


DOCUMENTS = ["The broker keeps a queue of jobs.", "Each stage holds a contiguous range of layers and its cache.",
             "Nothing is lost when a process dies.", "Numbers like 42 and 7 stay as they are.",
             "A worker claims an item, runs it and writes the answer.", "Small models load in a moment.",
             "The sea was calm that morning.", "Heartbeats tell the broker who is alive."]


def shared_prefix_requests(tokenizer) -> list[GenerationRequest]:
    return [GenerationRequest(f"d{i}", tokenizer(SYSTEM + text).input_ids, max_new_tokens=5 + i % 4)
            for i, text in enumerate(DOCUMENTS)]


@pytest.mark.parametrize(("arch", "num_stages", "overrides"), [
    ("llama", 1, {}), ("llama", 2, {}), ("qwen2", 3, {}), ("mistral", 2, {"sliding_window": 24}),
])
def test_shared_prefixes_match_transformers_with_the_cache_on_and_off(tiny_models, arch, num_stages, overrides):
    from transformers import AutoTokenizer

    model_dir = tiny_models(arch, num_hidden_layers=4, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    requests = shared_prefix_requests(tokenizer)
    # 2 slots for 8 prompts: later prompts arrive once the shared prefix is saved.
    on, on_stats, stages = run_and_read_stages(model_dir, num_stages, requests, num_slots=2, max_step_tokens=16,
                                               prefix_cache=PrefixCacheConfig(budget_tokens=512, block_tokens=8))
    off, _ = run_pipeline(model_dir, num_stages, requests, num_slots=2, max_step_tokens=16,
                          prefix_cache=PrefixCacheConfig(budget_tokens=0))
    shared = len(tokenizer(SYSTEM).input_ids) // 8 * 8 - 8  # at least this much restored per late prompt
    figures = on_stats.prefix_cache
    assert figures["hits"] >= len(requests) - 3 and figures["restored_tokens"] >= shared * (len(requests) - 3)
    assert [r.token_ids for r in on] == [r.token_ids for r in off], "the cache changed an output"
    assert assert_equivalent(model, requests, on) >= len(requests) - 1
    for name, stats in stages.items():
        assert 0 < stats["prefix_tokens_peak"] <= 512, name


@pytest.mark.parametrize(("arch", "num_stages", "overrides"), [
    ("llama", 2, {}), ("mistral", 3, {"sliding_window": 24}),
])
def test_eval_contexts_sharing_examples_score_as_a_full_pass_with_the_cache(tiny_models, arch, num_stages, overrides):
    """Few-shot questions share their examples: each question's context after the first two is copied from
    the cache, and every choice still scores what one plain forward over context + choice gives."""
    from transformers import AutoTokenizer

    from tests.helpers.equivalence import full_pass_scores

    model_dir = tiny_models(arch, num_hidden_layers=4, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    examples = tokenizer(SYSTEM + " ".join(DOCUMENTS[:3])).input_ids
    choices = tuple(tuple(tokenizer(f" {word}").input_ids) for word in ("yes", "no idea at all", "maybe"))
    requests = [ScoreRequest(f"q{i}", (ScoreSegment(tuple(examples + tokenizer(f" Question: {text}").input_ids),
                                                    choices),))
                for i, text in enumerate(DOCUMENTS)]
    # 4 slots: the cache may hold a quarter of their positions (4 x 256 / 4), room for the 160 shared. One
    # micro-batch: the schedule does not depend on which stage's result comes back first.
    results, stats, stages = run_and_read_stages(model_dir, num_stages, requests, num_slots=4, num_micro_batches=1,
                                                 max_step_tokens=16,
                                                 prefix_cache=PrefixCacheConfig(budget_tokens=512, block_tokens=8))
    shared = len(examples) // 8 * 8  # every late question restores the examples' whole blocks
    figures = stats.prefix_cache
    # One question sees the examples first, the next saves them (the others wait for the save); the rest copy them.
    late = len(requests) - 2
    assert figures["hits"] >= late and figures["restored_tokens"] >= shared * late, figures
    for request, result in zip(requests, results):
        assert result.error is None, result.error
        context = list(request.segments[0].context_ids)
        for choice, score in zip(choices, result.scores):
            expected, greedy = full_pass_scores(model, context, list(choice))
            torch.testing.assert_close(torch.tensor(score.logprobs), expected, atol=1e-4, rtol=0)
            assert list(score.greedy) == greedy
    for name, stage_stats in stages.items():
        assert 0 < stage_stats["prefix_tokens_peak"] <= 512, name


def test_a_tiny_budget_evicts_and_is_never_exceeded(tiny_models):
    from transformers import AutoTokenizer

    model_dir = tiny_models("llama", num_hidden_layers=4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Two families of prompts with different long prefixes, alternating: a budget that holds one
    # family's prefix at a time must evict the other's again and again. (Prefixes of about 50 tokens: the
    # cache takes at most a quarter of the slots' positions, 64 for one slot of this model's 256.)
    systems = ["Summarize the document below in one sentence, keeping every name and number as it is: ",
               "Translate the following sentence into French, word for word, with no notes at all: "]
    requests = [GenerationRequest(f"t{i}", tokenizer(systems[i % 2] + DOCUMENTS[i % len(DOCUMENTS)]).input_ids,
                                  max_new_tokens=4) for i in range(12)]
    longest_prefix = max(len(tokenizer(system).input_ids) for system in systems) // 8 * 8
    budget = longest_prefix + 8  # room for one family's prefix, never both
    assert budget <= 256 // 4, "the quarter cap would shrink the budget the test means"
    results, stats, stages = run_and_read_stages(model_dir, 2, requests, num_slots=1, max_step_tokens=32,
                                                 prefix_cache=PrefixCacheConfig(budget_tokens=budget, block_tokens=8))
    assert stats.prefix_cache["evicted_entries"] >= 2 and stats.prefix_cache["hits"] >= 2
    for name, stage in stages.items():
        assert stage["prefix_tokens_peak"] <= budget, f"{name} held {stage['prefix_tokens_peak']} > {budget}"
    assert assert_equivalent(model, requests, results) >= len(requests) - 1


def test_the_next_job_on_the_same_stages_restores_what_the_last_one_saved(tiny_models):
    from transformers import AutoTokenizer

    model_dir = tiny_models("llama", num_hidden_layers=4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = shared_prefix_requests(tokenizer)
    batching = BatchingConfig(num_slots=2, max_step_tokens=16,
                              prefix_cache=PrefixCacheConfig(budget_tokens=512, block_tokens=8))
    with LocalCluster(BrokerConfig(str(model_dir), 2, batching=batching), LocalStageOptions(threads_per_stage=1)) as cluster:
        first, _ = cluster.broker.generate(requests[:4])
        second, stats = cluster.broker.generate(requests[4:])
    assert stats.prefix_cache["hits"] == 4 and stats.prefix_cache["saved_entries"] == 0, stats.prefix_cache
    off, _ = run_pipeline(model_dir, 2, requests, num_slots=2, max_step_tokens=16,
                          prefix_cache=PrefixCacheConfig(budget_tokens=0))
    assert [r.token_ids for r in first + second] == [r.token_ids for r in off]


def test_kill_9_of_a_stage_mid_job_changes_no_output_with_prefixes_cached(tiny_models):
    """A re-plan empties every stage's cache: the bookkeeping starts again, and the outputs are those of a
    run with the cache off and no fault."""
    from transformers import AutoTokenizer

    from tests.helpers.faulted_runs import kill_middle_after
    from tests.helpers.faulted_runs import run as run_with_faults

    model_dir = tiny_models("llama", num_hidden_layers=6)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = [GenerationRequest(f"k{i}", tokenizer(SYSTEM + DOCUMENTS[i % len(DOCUMENTS)] + f" ({i})").input_ids,
                                  max_new_tokens=24) for i in range(16)]
    cached = PrefixCacheConfig(budget_tokens=1024, block_tokens=8)
    killed: list[str] = []
    batching = BatchingConfig(num_slots=4, num_micro_batches=4, max_step_tokens=32)
    faulted, stats = run_with_faults(model_dir, requests, on_result=kill_middle_after(4, killed),
                                     batching=replace(batching, prefix_cache=cached))
    clean, _ = run_with_faults(model_dir, requests, batching=replace(batching, prefix_cache=PrefixCacheConfig(0)))
    assert killed and len(stats.recoveries) == 1
    assert stats.prefix_cache["hits"] >= 4, stats.prefix_cache
    assert {k: r.token_ids for k, r in faulted.items()} == {k: r.token_ids for k, r in clean.items()}
