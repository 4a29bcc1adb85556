"""Next-token choice on the last stage: greedy, or temperature / top-k / top-p with a per-item seed.

A sampled token depends only on (seed, position) and the logits, never on which micro-batch or
stage count produced them, so rerunning a job reproduces its sampled outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from layerbus.stages.forward import head_logits
from layerbus.stages.shard import StageShard
from layerbus.wire.constraint import MASK_KEY, unpack_mask
from layerbus.wire.protocol import StepRow
from layerbus.wire.sampling import (
    DRAFT_MASKS_KEY,
    MAX_TOP_LOGPROBS,
    TOP_LOGPROBS_KEY,
    SamplingParams,
    row_drafts,
)

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the seed space


def choose_token(logits: torch.Tensor, params: SamplingParams, position: int,
                 log_probs: torch.Tensor | None = None) -> tuple[int, float]:
    """Pick the token for `position` from float32 logits [vocab]; returns (token, its log-prob).
    `log_probs` may be passed when the caller computed them for a whole batch at once."""
    if log_probs is None:
        log_probs = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, float(log_probs[token])
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    generator = torch.Generator().manual_seed((params.seed * _SEED_MIX + position) % (1 << 63))
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(log_probs[token])


def allowed_tokens(packed: str, vocab_size: int) -> torch.Tensor:
    """A row's token mask (wire/constraint.py) as bool [vocab_size]; tokens past the mask are not allowed."""
    # numpy's unpackbits: 2.4x faster than shifting a uint8 tensor (80 against 190 us for 49k tokens).
    bits = numpy.unpackbits(numpy.frombuffer(unpack_mask(packed), dtype=numpy.uint8), bitorder="little")
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    count = min(vocab_size, bits.size)
    allowed[:count] = torch.from_numpy(bits[:count].astype(bool))
    if not allowed.any():
        raise ValueError("the token mask allows no token of this vocabulary")
    return allowed


def target_log_probs(logits: torch.Tensor, targets: list[int]) -> tuple[list[float], list[bool]]:
    """Log-probabilities of given next tokens, one per position (logits [T, vocab], targets [T]), and
    whether each target is the argmax: lm-evaluation-harness's is_greedy, position by position."""
    log_probs = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logits.device).unsqueeze(1)
    greedy = logits.argmax(dim=-1) == index.squeeze(1)
    return log_probs.gather(1, index).squeeze(1).tolist(), greedy.tolist()


@dataclass(frozen=True)
class Pick:
    """One token the last stage picks: after a plain emitting row's last position, or after each position of a
    row with drafts (the drafts are then accepted while each equals the pick before it)."""

    row: int  # index into the step's emitting rows
    at: int  # index into the step's hidden states
    position: int  # the sampler's position: that of the token picked
    mask: str | None  # the packed allow-mask of a constrained row at this position


def _greedy_picks(picks: list[Pick], params: list[SamplingParams], logits: torch.Tensor,
                  log_probs: torch.Tensor) -> dict[int, tuple[int, float]]:
    """Token and log-prob of each greedy pick without a grammar mask, by index into `picks`: one argmax over
    all of them where the logits are. On a GPU this is what keeps [picks, vocab] float32 logits (50 MB
    for 256 rows of a 49k vocabulary) from crossing to the CPU every step, with a single-threaded
    log-softmax and an argmax per row after them. torch.argmax takes the first of equal maxima on CPU
    and CUDA alike, as choose_token's does."""
    plain = [i for i, pick in enumerate(picks) if params[pick.row].greedy and pick.mask is None]
    if not plain:
        return {}
    if len(plain) < len(picks):
        index = torch.tensor(plain, device=logits.device)
        logits, log_probs = logits.index_select(0, index), log_probs.index_select(0, index)
    best = logits.argmax(dim=-1)
    best_log_probs = log_probs.gather(1, best.unsqueeze(1)).squeeze(1)
    return dict(zip(plain, zip(best.tolist(), best_log_probs.tolist())))


def _picks_of(rows: list[StepRow]) -> tuple[list[StepRow], list[Pick], list[list[int]]]:
    """The emitting rows, the picks they ask for, and each emitting row's drafts (empty for a plain row)."""
    emitting, picks, drafts = [], [], []
    offset = 0
    for row in rows:
        if row.emit:
            index = len(emitting)
            emitting.append(row)
            own = row_drafts(row.sampling, row.length)
            drafts.append(own)
            if own:
                masks = [row.sampling.get(MASK_KEY), *row.sampling.get(DRAFT_MASKS_KEY, [None] * len(own))]
                picks.extend(Pick(index, offset + i, row.start + i + 1, masks[i]) for i in range(row.length))
            else:
                picks.append(Pick(index, offset + row.length - 1, row.start + row.length, row.sampling.get(MASK_KEY)))
        offset += row.length
    return emitting, picks, drafts


def last_stage_outputs(shard: StageShard, rows: list[StepRow], hidden: torch.Tensor) -> dict:
    """The result of a step on the last stage: each emitting row's next token with its log-prob, each scored
    row's log-probs of its targets, and the drafts accepted before the token of each row that carried drafts
    (the result message's tokens, scores and accepted)."""
    scores = []
    scored_rows, scored_positions = [], []
    offset = 0
    for row in rows:
        if row.targets:
            scored_rows.append(row)
            scored_positions.extend(range(offset, offset + len(row.targets)))
        offset += row.length
    if scored_rows:
        # One head matmul for every scored position of the step (an eval step scores dozens of short
        # rows; one call each would read the head's weights, the largest a stage holds, once per row).
        # Scored where the logits are: only a log-prob and a flag per position leave a GPU, not [positions,
        # vocab] float32 logits. Row by row, so that a log-softmax never doubles the logits' memory.
        logits = head_logits(shard, hidden[scored_positions])
        start = 0
        for row in scored_rows:
            count = len(row.targets)
            scores.append([row.slot, *target_log_probs(logits[start:start + count], row.targets)])
            start += count
    emitting, picks, drafts = _picks_of(rows)
    if not picks:
        return {"tokens": [], "scores": scores}
    chosen = _choose(shard, emitting, picks, hidden)
    tokens, accepted = [], []
    first = 0
    for i, row in enumerate(emitting):
        count = len(drafts[i]) + 1
        row_chosen = chosen[first:first + count]
        first += count
        taken = 0
        while taken < len(drafts[i]) and row_chosen[taken][1] == drafts[i][taken]:
            taken += 1
        if drafts[i]:
            accepted.append([row.slot, [entry[1:] for entry in row_chosen[:taken]]])
        tokens.append(row_chosen[taken])
    result = {"tokens": tokens, "scores": scores}
    if accepted:
        result["accepted"] = accepted
    return result


def _choose(shard: StageShard, emitting: list[StepRow], picks: list[Pick], hidden: torch.Tensor) -> list[list]:
    """[slot, token, logprob(, top)] for each pick, in order."""
    # One head matmul for all picks: the head is the largest weight a stage reads.
    logits = head_logits(shard, hidden[[pick.at for pick in picks]])
    log_probs = torch.log_softmax(logits, dim=-1)  # one pass for the whole batch, where the logits are
    params = [SamplingParams.from_json(row.sampling) for row in emitting]
    picked = _greedy_picks(picks, params, logits, log_probs)
    # The other picks (sampled with a seed on the CPU's generator, or masked by a grammar) get their own
    # logits on the CPU; a greedy job sends none of them there.
    others = [i for i in range(len(picks)) if i not in picked]
    if others:
        cpu_rows = dict(zip(others, zip(logits[others].cpu(), log_probs[others].cpu())))
    chosen = []
    for i, pick in enumerate(picks):
        row, row_params = emitting[pick.row], params[pick.row]
        if i in picked:
            token, logprob = picked[i]
        else:
            row_logits, row_log_probs = cpu_rows[i]
            if pick.mask is not None:
                # Constrained: the broker's grammar says which tokens may come next. The log-prob returned
                # stays the model's own (row_log_probs, unmasked), as OpenAI's logprobs are.
                allowed = allowed_tokens(pick.mask, row_logits.numel())
                row_logits = row_logits.masked_fill(~allowed, float("-inf"))
            token, logprob = choose_token(row_logits, row_params, pick.position, row_log_probs)
        top = row.sampling.get(TOP_LOGPROBS_KEY)
        if isinstance(top, int) and 0 < top <= MAX_TOP_LOGPROBS:
            # The model's own distribution (unmasked, untempered), as OpenAI's top_logprobs are.
            values, ids = torch.topk(log_probs[i], min(top, log_probs.shape[-1]))
            chosen.append([row.slot, token, logprob, [list(pair) for pair in zip(ids.tolist(), values.tolist())]])
        else:
            chosen.append([row.slot, token, logprob])
    return chosen
