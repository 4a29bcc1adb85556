"""A job's work as the plan sees it: its items' prompt lengths and output budgets, turned into the
sequence of steps the scheduler will send, summed over consecutive windows of the run.

A job comes in phases: prompts are prefilled (long steps of prompt tokens), then decoded (short
steps of one row per sequence whose attention grows with the context), and at the end fewer and
fewer sequences are left. Each phase has its own slowest stage, so the plan prices each window
separately and adds them up. The steps are the broker's own: the real `Scheduler` is run on the
items (pure bookkeeping), with each item's output ending after its expected length.

A large job is described by an evenly spread sample of its items (jobs/job_workload.py: reading and
tokenizing a million prompts would take minutes): `represents` says how many items the sample stands
for, and every sum the plan takes (steps, prompt and new tokens, hence job seconds and tokens/s) is
scaled up to them, as job_shape already scales the part of a long job it simulates.

Shared prompt prefixes: a job's items often start alike (the chat template's system part, the task's
instruction, an eval's few-shot examples), and the stages' prefix cache (broker/prefix_cache.py) copies
such a prefix instead of computing it. A workload made from the prompts themselves (`Workload.of_prompts`)
keeps, per item, which of its leading blocks another item shares (`prefix_blocks`), and the simulation
runs the scheduler with the prefix cache on prompts that share exactly those blocks. Planned from lengths
alone, a summarize job whose prompts were 40% shared prefix was priced for prefilling all of it: its
tokens/s predicted 17-27% under what ran over a slow link (bench/bench_topology.py).

Output lengths: an item runs to its max_new_tokens unless told otherwise (`output_fraction`, the
shares of their budgets where earlier outputs ended (`output_shares`), or the lengths themselves after
a run). The planner cannot know where outputs end at EOS; the job runner estimates them only from what
is measured (items of the same model and task that already finished). It passes the shares, not their
mean: a job ends with its longest outputs, and one mean share for all ended every output at once. The
README's summaries ended anywhere from 12% to 100% of their budgets (mean 63%); priced at the mean the
job was 536 steps where 808 ran, its last third a dozen outputs running on to their budgets.
Before any output of the model and task has ended, the shares are assumed spread evenly up to the
budget (`ASSUMED_OUTPUT_SHARES`): outputs end at EOS, nobody knows where before they run, and a budget
is a cap users set above what they expect. Every item to its budget was the one guess sure to be wrong for a job that
ends at EOS: it predicted the README's first run at 141 tok/s where 88 ran (105 for the lengths it made).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

from layerbus.planner.prefix_budget import PrefixCacheConfig, block_hashes
from layerbus.planner.sample_places import GOLDEN, sample_places
from layerbus.planner.step_cost import StepWork, prefill_context

WINDOWS = 16  # windows a job is priced in: enough to tell prefill from decode from the drain
# Shares of their budgets outputs are assumed to end at when none of the model and task has ended yet:
# evenly anywhere from a 32nd of the budget to all of it (the least informed guess; the mean is about half).
ASSUMED_OUTPUT_SHARES = tuple((k + 1) / 32 for k in range(32))


@dataclass(frozen=True)
class Workload:
    """What a job asks for: per item (of the job, or of a sample of it), its prompt length and output budget."""

    prompt_lengths: tuple[int, ...]
    max_new_tokens: tuple[int, ...]
    output_fraction: float = 1.0  # expected new tokens / budget (1: every item runs to its limit)
    output_lengths: tuple[int, ...] | None = None  # known lengths (after a run), instead of the fraction
    # Items the lengths stand for when they are an evenly spread sample of a larger job, each standing for
    # represents / len(prompt_lengths) of them. None: they are the job's own items, one each.
    represents: int | None = None
    # Positions the longest item of the whole job reaches, where these are one chain's share of it
    # (`share`): the KV caches are made that long at load, as the chain may take any item of the job.
    job_longest: int = 0
    # Per item, its leading blocks of `prefix_block_tokens` prompt tokens that another item of the
    # workload starts with too, each named by an id (equal ids: equal prompts up to that block's end).
    # None: not known (made from lengths alone); the plan then prices every prompt token as computed.
    prefix_blocks: tuple[tuple[int, ...], ...] | None = None
    prefix_block_tokens: int = PrefixCacheConfig().block_tokens
    # Where earlier outputs of the same model and task ended, each as a share of its budget, sorted
    # (`with_output_shares`); the items are given them spread over the queue (`spread_shares`). None: every
    # item ends at `output_fraction` of its budget.
    output_shares: tuple[float, ...] | None = None
    output_shares_assumed: bool = False  # the shares are ASSUMED_OUTPUT_SHARES, not earlier outputs'

    def __post_init__(self) -> None:
        if len(self.prompt_lengths) != len(self.max_new_tokens):
            raise ValueError(f"{len(self.prompt_lengths)} prompt lengths but {len(self.max_new_tokens)} budgets")
        if self.output_lengths is not None and len(self.output_lengths) != len(self.prompt_lengths):
            raise ValueError(f"{len(self.output_lengths)} output lengths for {len(self.prompt_lengths)} items")
        if not 0 < self.output_fraction <= 1:
            raise ValueError(f"output_fraction must be in (0, 1], got {self.output_fraction}")
        if self.output_shares is not None and not (
                self.output_shares and all(0 < share <= 1 for share in self.output_shares)
                and list(self.output_shares) == sorted(self.output_shares)):
            raise ValueError(f"output_shares must be shares in (0, 1], at least one, sorted; got {self.output_shares}")
        if self.represents is not None and not 0 < len(self.prompt_lengths) <= self.represents:
            raise ValueError(f"a sample of {len(self.prompt_lengths)} items cannot stand for {self.represents}: "
                             "a sample has at least one item and at most as many as the job")
        if self.prefix_blocks is not None:
            if len(self.prefix_blocks) != len(self.prompt_lengths):
                raise ValueError(f"{len(self.prefix_blocks)} prefix signatures for {len(self.prompt_lengths)} items")
            for blocks, length in zip(self.prefix_blocks, self.prompt_lengths):
                if len(blocks) * self.prefix_block_tokens > length:
                    raise ValueError(f"{len(blocks)} shared blocks of {self.prefix_block_tokens} tokens do not fit "
                                     f"a prompt of {length} tokens")

    @classmethod
    def of(cls, prompt_lengths: Sequence[int], max_new_tokens: int | Sequence[int],
           output_fraction: float = 1.0, represents: int | None = None) -> "Workload":
        budgets = ([int(max_new_tokens)] * len(prompt_lengths) if isinstance(max_new_tokens, int)
                   else [int(m) for m in max_new_tokens])
        return cls(tuple(int(n) for n in prompt_lengths), tuple(budgets), output_fraction, None, represents)

    @classmethod
    def of_prompts(cls, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                   output_fraction: float = 1.0, represents: int | None = None,
                   block_tokens: int = PrefixCacheConfig().block_tokens,
                   samples: Sequence[int] | None = None) -> "Workload":
        """From the items' prompt tokens: their lengths, and which leading blocks each shares with another
        item (what the prefix cache can copy instead of computing). `samples`: sequences each item runs (its
        n samples, one per item if None), each listed as an item of the workload. An item's samples share
        what the item shares with other items, not their whole prompt with each other: in a sample of a
        large job, job_shape runs each item several times over for items like it, which would otherwise
        all share one prompt; with n = 2 the second sample would only save what no third one restores."""
        counts = list(samples) if samples is not None else [1] * len(prompts)
        if len(counts) != len(prompts):
            raise ValueError(f"{len(counts)} sample counts for {len(prompts)} prompts")
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        blocks = shared_prefix_blocks(prompts, block_tokens)

        def each_sample(values: Sequence) -> list:
            return [value for value, count in zip(values, counts) for _ in range(count)]

        return replace(cls.of(each_sample([len(prompt) for prompt in prompts]), each_sample(budgets), output_fraction,
                              represents),
                       prefix_blocks=tuple(each_sample(blocks)), prefix_block_tokens=block_tokens)

    @property
    def longest_sequence(self) -> int:
        """Positions the longest item can reach (its prompt plus its output budget); 0 for no items. Of a
        sample, the sample's longest, which a larger job's may pass."""
        return max(max((p + m for p, m in zip(self.prompt_lengths, self.max_new_tokens)), default=0), self.job_longest)

    @property
    def items(self) -> int:
        """Items of the job (what batch sizes and the plan are for), sampled or not."""
        return self.represents if self.represents is not None else len(self.prompt_lengths)

    @property
    def weight(self) -> float:
        """Items of the job each listed item stands for (1 unless the lengths are a sample)."""
        return self.items / len(self.prompt_lengths) if self.prompt_lengths else 1.0

    def expected_lengths(self) -> list[int]:
        if self.output_lengths is not None:
            return [max(1, min(n, m)) for n, m in zip(self.output_lengths, self.max_new_tokens)]
        if self.output_shares is not None:
            # A sample's items are given the shares their places in the job get, so a sample is priced as
            # the whole job is (each part of the distribution where the job has it, not a draw of its own)
            places = (sample_places(len(self.max_new_tokens), self.represents) if self.represents is not None
                      else range(len(self.max_new_tokens)))
            shares = spread_shares(self.output_shares, places)
            return [max(1, round(m * share)) for m, share in zip(self.max_new_tokens, shares)]
        return [max(1, round(m * self.output_fraction)) for m in self.max_new_tokens]

    def with_output_shares(self, shares: Sequence[float], assumed: bool = False) -> "Workload":
        """The workload told where earlier outputs ended, as shares of their budgets (any order; `assumed`:
        not measured, a guess such as ASSUMED_OUTPUT_SHARES); its `output_fraction` becomes their mean."""
        ordered = tuple(sorted(float(share) for share in shares))
        if not ordered:
            raise ValueError("output_shares needs at least one share: without any, leave the workload as it is")
        return replace(self, output_shares=ordered, output_fraction=sum(ordered) / len(ordered), output_lengths=None,
                       output_shares_assumed=assumed)

    def with_output_lengths(self, lengths: Sequence[int]) -> "Workload":
        """The workload told where outputs ended: one length per listed item, or, for a sample, one per
        item of the job in the order they ran, of which those at the sample's places are kept (the
        sample is spread evenly over the queue, which the run follows, so the mix is the job's)."""
        if self.represents is not None and len(lengths) == self.represents != len(self.prompt_lengths):
            lengths = [lengths[p] for p in sample_places(len(self.prompt_lengths), self.represents)]
        return replace(self, output_fraction=1.0, output_shares=None, output_shares_assumed=False,
                       output_lengths=tuple(int(n) for n in lengths))

    def share(self, index: int, count: int) -> "Workload":
        """The part of the job that one of `count` brokers (chains) working it side by side runs, the one
        at `index`: each holds an even share of the items not yet done (jobs/claim_share.py) and claims in
        the queue's order, so its items are about every count-th one. Planned for the whole job instead,
        each chain sized its batches for items it never gets and predicted the ramp-up and drain of a job
        `count` times as long as its own. Of a sample: the same sample, standing for a count-th of the items."""
        if not 0 <= index < count:
            raise ValueError(f"chain index {index} is not one of {count} chain(s)")
        if count == 1 or not self.items:
            return self
        if self.represents is not None:
            return replace(self, represents=max(len(self.prompt_lengths), round(self.represents / count)))
        places = list(range(index, len(self.prompt_lengths), count)) or [index % len(self.prompt_lengths)]

        def pick(values: tuple | None) -> tuple | None:
            return tuple(values[i] for i in places) if values is not None else None

        return replace(self, prompt_lengths=pick(self.prompt_lengths), max_new_tokens=pick(self.max_new_tokens),
                       output_lengths=pick(self.output_lengths), job_longest=self.longest_sequence,
                       prefix_blocks=pick(self.prefix_blocks))

    def describe(self) -> str:
        if not self.items:
            return "no items"
        prompts = sorted(self.prompt_lengths)
        outputs = self.expected_lengths()
        sampled = f" (a sample of {len(prompts)} of them)" if self.represents is not None else ""
        shares = self.output_shares
        told = ("lengths as produced" if self.output_lengths is not None else
                f"{self.output_fraction:.0%} of the limit on average, assumed spread evenly up to it: no output of "
                "this model and task has ended yet" if shares is not None and self.output_shares_assumed else
                f"{self.output_fraction:.0%} of the limit on average, {shares[0]:.0%} to {shares[-1]:.0%} "
                f"as {len(shares)} earlier outputs ended" if shares is not None else
                "every item to its limit" if self.output_fraction == 1 else f"{self.output_fraction:.0%} of the limit")
        return (f"{self.items} items{sampled}, prompts {prompts[0]}-{prompts[-1]} tokens "
                f"(mean {sum(prompts) / len(prompts):.0f}), up to {max(self.max_new_tokens)} new tokens, "
                f"expected {round(sum(outputs) * self.weight)} in all ({told})")


def spread_shares(shares: Sequence[float], places: Sequence[int]) -> list[float]:
    """The shares of their budgets the items at these places of the queue (0, 1, ...) are expected to use,
    taken from the sorted `shares` by the golden-ratio sequence: over any run of items each part of the
    distribution comes about equally often (the mean and the long tail are kept), the order is fixed but
    unrelated to the queue's (which items will run long is not known before they run), and an item's share
    depends on its place alone, so an evenly spread sample of the job's items gets the job's mix. A
    shuffle of each workload's items gave a sample of 300 of 3,000 items a draw of its own: the decode
    context it priced was 8.5% off the whole job's."""
    return [shares[min(len(shares) - 1, int((place + 1) * GOLDEN % 1.0 * len(shares)))] for place in places]


def shared_prefix_blocks(prompts: Sequence[Sequence[int]], block_tokens: int) -> tuple[tuple[int, ...], ...]:
    """Per prompt, ids of its leading full blocks that at least one other prompt starts with too (a
    block's id stands for every token up to its end, as the prefix cache's chained hashes do); the
    blocks after the first one no other prompt shares are its own and are left out."""
    hashes = [block_hashes(list(prompt), block_tokens) for prompt in prompts]
    starting_with = Counter(digest for chain in hashes for digest in chain)
    ids: dict[bytes, int] = {}
    signatures = []
    for chain in hashes:
        shared = []
        for digest in chain:
            if starting_with[digest] < 2:
                break
            shared.append(ids.setdefault(digest, len(ids)))
        signatures.append(tuple(shared))
    return tuple(signatures)


def mean_decode_context(workload: Workload | None) -> float | None:
    """Positions a decode row attends over, on average: its prompt plus half its output."""
    if workload is None or not workload.items:
        return None
    outputs = workload.expected_lengths()
    return (sum(workload.prompt_lengths) + sum(outputs) / 2) / len(workload.prompt_lengths)


@dataclass(frozen=True)
class Window:
    """Consecutive steps of a run, summed: what each stage computes in them, and how many new tokens."""

    work: StepWork
    new_tokens: float
    longest_chain: float  # steps of the busiest micro-batch: its steps go through the chain one after another


@dataclass(frozen=True)
class JobShape:
    """The windows of a job's run under one batching."""

    windows: tuple[Window, ...]

    @property
    def total(self) -> StepWork:
        work = StepWork()
        for window in self.windows:
            work = work + window.work
        return work

    @property
    def new_tokens(self) -> float:
        return sum(w.new_tokens for w in self.windows)


def steady_shape(micro_batch_size: int, num_micro_batches: int, prompt_tokens_per_new_token: float,
                 kv_length: int, chunk_tokens: int) -> JobShape:
    """Without a workload: one window of one step per micro-batch, each with a full micro-batch of
    decode rows at `kv_length` plus the prompt tokens the workload brings per new token (the plan of
    an unknown job: `layerbus plan --prompt-ratio`, a broker serving whatever comes)."""
    rows, m = micro_batch_size, num_micro_batches
    tokens = prompt_tokens_per_new_token * rows
    chunks = tokens / chunk_tokens if tokens else 0.0
    per_step = StepWork(steps=1, passes=1, decode_rows=rows, decode_kv=rows * (kv_length + 1),
                        prefill_tokens=tokens, prefill_ctx=chunks * prefill_context(0, chunk_tokens) if chunks else 0.0,
                        emit_steps=1, emit_rows=rows)
    return JobShape((Window(per_step.scaled(m), rows * m, 1.0),))
