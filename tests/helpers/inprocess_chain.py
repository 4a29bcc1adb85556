"""A chain of stages in one process: the real scheduler, step rows, packed forward steps and last-stage picks,
with no sockets. What the pipeline does with a step, minus the transport: for tests that compare whole runs
(speculation on against off) quickly and exactly."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from layerbus.broker.detokenizer import IncrementalDetokenizer
from layerbus.broker.grammar import GrammarCompiler
from layerbus.broker.scheduler import Scheduler
from layerbus.broker.step_rows import step_rows
from layerbus.models.model_info import read_model_info
from layerbus.planner.batching import BatchingConfig
from layerbus.stages.forward import run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.sampling import last_stage_outputs
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.wire.spans import LayerRange


class InProcessChain:
    """Stages over `spans` of a model directory, each with its own KV arena of `num_slots` slots."""

    def __init__(self, model_dir: Path, spans: list[tuple[int, int]], num_slots: int, max_context: int = 512):
        info = read_model_info(model_dir)
        self.info = info
        last = spans[-1][1]
        self.stages = []
        for start, end in spans:
            shard = load_shard(info.files, ShardSpec(LayerRange(start, end), start == 0, end == last))
            config = shard.config
            arena = KVArena(list(range(start, end)), num_slots, config.num_key_value_heads, config.head_dim,
                            torch.float32, torch.device("cpu"), max_context)
            self.stages.append((shard, arena))

    def step(self, rows, tokens: list[int]) -> dict:
        data = torch.tensor(tokens, dtype=torch.int64)
        for shard, arena in self.stages:
            data = run_step(shard, arena, rows, data)
        return last_stage_outputs(self.stages[-1][0], rows, data)

    def release(self, slots: list[int]) -> None:
        for _, arena in self.stages:
            for slot in slots:
                arena.release(slot)


def new_scheduler(model_dir: Path, batching: BatchingConfig, num_stages: int, grammar: bool = False) -> Scheduler:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = read_model_info(model_dir)
    compiler = GrammarCompiler(model_dir, set(info.eos_ids), info.files.config.vocab_size) if grammar else None
    return Scheduler(batching, num_stages, set(info.eos_ids), lambda: IncrementalDetokenizer(tokenizer),
                     compiler.new if compiler is not None else None)


def drive(scheduler: Scheduler, chain: InProcessChain, requests, on_step=None) -> dict:
    """Run the requests to the end, one micro-batch step after another, as the pipeline would; `on_step(count)`
    runs after each step (a test's fault). Returns request id -> result."""
    results = {}
    for request in requests:
        failed = scheduler.submit(request, 0.0)
        if failed is not None:
            results[request.request_id] = failed
    steps = 0
    while not scheduler.idle:
        for mb in range(scheduler.num_micro_batches):
            plan = scheduler.plan_step(mb, 0.0)
            if plan is None:
                continue
            chain.release(plan.released)
            rows, tokens = step_rows(scheduler, plan)
            result = chain.step(rows, tokens) if rows else {"tokens": []}
            picked = {entry[0]: tuple(entry[1:]) for entry in result["tokens"]}
            accepted = {slot: taken for slot, taken in result.get("accepted", [])}
            for done in scheduler.apply_result(plan, picked, 0.0, {}, accepted):
                results[done.request_id] = done
            steps += 1
            if on_step is not None:
                on_step(steps)
    return results
