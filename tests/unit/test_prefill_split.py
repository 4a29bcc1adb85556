"""Prefill logits of a model split into three shards, run in process in chunks with several prompts per step,
equal the whole model's in transformers. tests/equivalence/test_equivalence.py runs the split as real stages."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerbus.models.model_files import open_model_dir
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from tests.helpers.equivalence import TINY_PROMPTS


def test_prefill_logits_match_across_split(tiny_models):
    """Prefill logits of a 3-way split (in chunks, several prompts per step) equal the whole model's."""
    model_dir = tiny_models("qwen2", num_hidden_layers=6)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    files = open_model_dir(model_dir)
    spans = [LayerRange(0, 2), LayerRange(2, 3), LayerRange(3, 6)]
    shards = [load_shard(files, ShardSpec(span, i == 0, i == 2)) for i, span in enumerate(spans)]
    config = files.config
    arenas = [KVArena(list(span), 4, config.num_key_value_heads, config.head_dim, torch.float32,
                      torch.device("cpu"), 256) for span in spans]
    prompts = [tokenizer(p).input_ids for p in TINY_PROMPTS[:3]]
    chunk = 7
    logits_by_prompt = {i: [] for i in range(len(prompts))}
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        rows, tokens = [], []
        for i, prompt in enumerate(prompts):
            if done[i] < len(prompt):
                part = prompt[done[i]:done[i] + chunk]
                rows.append(StepRow(i, done[i], len(part)))
                tokens.extend(part)
                done[i] += len(part)
        hidden = torch.tensor(tokens)
        for shard, arena in zip(shards, arenas):
            hidden = run_step(shard, arena, rows, hidden)
        logits = head_logits(shards[-1], hidden)
        offset = 0
        for row in rows:
            logits_by_prompt[row.slot].append(logits[offset:offset + row.length])
            offset += row.length
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(torch.cat(logits_by_prompt[i]), reference, atol=1e-4, rtol=1e-4)
