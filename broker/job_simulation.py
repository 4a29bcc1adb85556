"""A job's steps as the broker's own scheduler would send them: the real `Scheduler` run over a workload
(pure bookkeeping, no sockets), each item's output ending after its expected length, summed into the
windows the planner prices (planner.workload.JobShape). It lives beside the scheduler it runs; the
planner is handed its result."""

from __future__ import annotations

import math
from dataclasses import replace

from layerbus.broker.prefix_cache import PrefixIndex
from layerbus.broker.requests import GenerationRequest
from layerbus.broker.scheduler import Scheduler
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.prefix_budget import prefix_positions
from layerbus.planner.step_cost import StepWork, prefill_context
from layerbus.planner.workload import WINDOWS, JobShape, Window, Workload

MAX_SIMULATED_ROWS = 200_000  # decode rows simulated at most; a larger job is simulated on a sample of its items
_TOKEN, _EOS = 0, 1
# Simulated prompts: a shared block's tokens and each sequence's own tail are drawn from ranges that no
# other simulated token uses, so prompts share blocks exactly where the workload says.
_SHARED_BLOCK_TOKEN, _OWN_TAIL_TOKEN = 1 << 40, 1 << 50


def job_shape(workload: Workload, batching: BatchingConfig, windows: int = WINDOWS) -> JobShape:
    """Run the scheduler over the workload (a sample of it when it is large) and sum its steps in
    `windows` windows of equal step counts, scaled to every item the workload stands for.
    `batching` must be resolved (slots, micro-batches)."""
    if not workload.items:
        return JobShape(())
    lengths = workload.expected_lengths()
    rows = sum(lengths)
    # A sample's items each go in for as many of the job's as fit in MAX_SIMULATED_ROWS (one after
    # another, in the queue's order): scaling a run of the sample alone would scale its ramp-up and
    # drain with it, where slots are not full (a sample of 600 items on 512 slots: 30% more steps
    # than the job's), while in the job the full middle dominates.
    copies = max(1, min(int(workload.weight), MAX_SIMULATED_ROWS // max(1, rows)))
    items = [i for i in range(len(lengths)) for _ in range(copies)]
    if rows * copies > MAX_SIMULATED_ROWS:  # every k-th item: the same mix, fewer of them; sums scaled back
        stride = math.ceil(rows / MAX_SIMULATED_ROWS)
        items = items[::stride]
    scale = workload.weight * rows / sum(lengths[i] for i in items)  # to every item the workload stands for
    steps = _simulate(workload, lengths, items, batching)
    out = []
    size = max(1, math.ceil(len(steps) / windows))
    for begin in range(0, len(steps), size):
        chunk = steps[begin:begin + size]
        work = StepWork()
        per_mb: dict[int, int] = {}
        new = 0
        for mb, step, emitted in chunk:
            work = work + step
            per_mb[mb] = per_mb.get(mb, 0) + 1
            new += emitted
        out.append(Window(work.scaled(scale), new * scale, max(per_mb.values()) * scale))
    return JobShape(tuple(out))


def _simulate(workload: Workload, lengths: list[int], items: list[int],
              batching: BatchingConfig) -> list[tuple[int, StepWork, int]]:
    """(micro-batch, what the step carries, new tokens it emits) for every step, in the order sent."""
    prefixes = _prefix_index(workload, batching)
    scheduler = Scheduler(batching, batching.num_micro_batches, {_EOS}, prefix_cache=prefixes)
    want: dict[str, int] = {}
    for n, i in enumerate(items):  # an item may go in more than once (a sample's): ids by place
        request = GenerationRequest(str(n), _prompt(workload, i, n) if prefixes is not None
                                    else [_TOKEN] * max(1, workload.prompt_lengths[i]),
                                    max_new_tokens=max(1, workload.max_new_tokens[i]))
        if scheduler.submit(request, 0.0) is None:  # a prompt too long for the context is refused, not run
            want[str(n)] = lengths[i]
    steps: list[tuple[int, StepWork, int]] = []
    idle_rounds = 0
    while not scheduler.idle and idle_rounds < 2:
        idle_rounds += 1
        for mb in range(scheduler.num_micro_batches):
            plan = scheduler.plan_step(mb, 0.0)
            if plan is None:
                continue
            idle_rounds = 0
            tokens = {}
            decode_rows = decode_kv = prefill_tokens = prefill_ctx = 0
            for row in plan.rows:
                length = len(row.tokens)
                if length == 1:  # one position: the stage runs it in the decode group (stages/forward.py)
                    decode_rows += 1
                    decode_kv += row.start + 1
                else:
                    prefill_tokens += length
                    prefill_ctx += prefill_context(row.start, length)
                if row.emit:
                    sequence = scheduler.active[row.slot]
                    done = len(sequence.generated) + 1 >= want[sequence.request.request_id]
                    tokens[row.slot] = (_EOS if done else _TOKEN, 0.0)
            emitted = len(tokens)
            # The stages run a step's rows, decode and prefill alike, in one packed pass over the layers
            # (stages/forward.py, packing), so its weights are read once per step with rows.
            work = StepWork(steps=1, passes=1 if plan.rows else 0, decode_rows=decode_rows,
                            decode_kv=decode_kv, prefill_tokens=prefill_tokens, prefill_ctx=prefill_ctx,
                            emit_steps=1 if emitted else 0, emit_rows=emitted)
            steps.append((mb, work, emitted))
            scheduler.apply_result(plan, tokens, 0.0)
    return steps


def _prefix_index(workload: Workload, batching: BatchingConfig) -> PrefixIndex | None:
    """The prefix cache as the broker runs it for this batching (Pipeline._prefix_index), where the
    workload says which prefixes its items share in blocks of the cache's size; None otherwise."""
    if workload.prefix_blocks is None or workload.prefix_block_tokens != batching.prefix_cache.block_tokens:
        return None
    positions = prefix_positions(batching.prefix_cache, batching.num_slots, batching.max_context)
    return PrefixIndex(replace(batching.prefix_cache, budget_tokens=positions)) if positions else None


def _prompt(workload: Workload, item: int, place: int) -> list[int]:
    """A simulated prompt of item `item` at place `place`: its shared blocks, then a tail of its own
    (two places of one sampled item share no more than two items of the job would)."""
    block = workload.prefix_block_tokens
    shared = [_SHARED_BLOCK_TOKEN + b for b in workload.prefix_blocks[item] for _ in range(block)]
    return shared + [_OWN_TAIL_TOKEN + place] * (max(1, workload.prompt_lengths[item]) - len(shared))
