"""What a step costs a stage, as a linear function of what the step carries.

A stage's time for a step is fitted from its profile (stages/profile_timing.py times the serving code at
several shapes) as fixed and proportional parts: per step (Python, rotary tables), per forward pass
over the layers (every pass reads every weight once; the stages pack a step's rows into one pass), per decode row, per decode row and cached position it attends over (reading the KV
cache), per prefill token, and per prefill token and position it attends over. Whatever makes the
step itself faster changes the fitted coefficients, not this form. Pure values, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StepWork:
    """What some steps carry, summed over them (one step, a window of a job, or a whole job)."""

    steps: float = 0.0
    passes: float = 0.0  # forward passes over the layers (the stages pack a step's rows into one)
    decode_rows: float = 0.0  # rows of one new token
    decode_kv: float = 0.0  # over decode rows: the positions each attends over (its cache + itself)
    prefill_tokens: float = 0.0
    prefill_ctx: float = 0.0  # over prefill tokens: the positions each attends over
    emit_steps: float = 0.0  # steps in which the last stage picks tokens
    emit_rows: float = 0.0  # rows whose next token the last stage picks

    def __add__(self, other: "StepWork") -> "StepWork":
        return StepWork(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor: float) -> "StepWork":
        return StepWork(*(getattr(self, f.name) * factor for f in fields(self)))

    @property
    def positions(self) -> float:
        """Hidden states the step moves on (what the first stage embeds and every link carries)."""
        return self.decode_rows + self.prefill_tokens


@dataclass(frozen=True)
class LinearCost:
    """Seconds for `StepWork`: the sum of each coefficient times its feature."""

    per_step_s: float = 0.0
    per_pass_s: float = 0.0
    per_row_s: float = 0.0
    per_row_kv_s: float = 0.0  # per decode row per position attended
    per_token_s: float = 0.0
    per_token_ctx_s: float = 0.0  # per prefill token per position attended

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value}")

    def of(self, work: StepWork) -> float:
        return (self.per_step_s * work.steps + self.per_pass_s * work.passes + self.per_row_s * work.decode_rows
                + self.per_row_kv_s * work.decode_kv + self.per_token_s * work.prefill_tokens
                + self.per_token_ctx_s * work.prefill_ctx)

    def scaled(self, factor: float) -> "LinearCost":
        return LinearCost(*(getattr(self, f.name) * factor for f in fields(self)))

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def decode_step(rows: int, kv_length: int) -> StepWork:
    """One step of `rows` decode rows, each with `kv_length` cached positions."""
    return StepWork(steps=1, passes=1, decode_rows=rows, decode_kv=rows * (kv_length + 1), emit_steps=1,
                    emit_rows=rows)


def prefill_step(tokens: int, start: int = 0) -> StepWork:
    """One step carrying one prefill chunk of `tokens` positions from position `start`."""
    return StepWork(steps=1, passes=1, prefill_tokens=tokens, prefill_ctx=prefill_context(start, tokens))


def prefill_context(start: int, tokens: int) -> int:
    """Positions attended over by a chunk's tokens: token i of the chunk sees start + i + 1."""
    return tokens * start + tokens * (tokens + 1) // 2


@dataclass(frozen=True)
class ProfilePoint:
    """One timed shape of the profile: the stage's time for it with one layer and per extra layer."""

    work: StepWork
    one_layer_s: float  # overhead + one layer
    per_layer_s: float  # what each further layer adds


def fit_costs(decode: ProfilePoint, decode_few_rows: ProfilePoint, decode_long_kv: ProfilePoint,
              prefill: ProfilePoint, prefill_late: ProfilePoint) -> tuple[LinearCost, LinearCost]:
    """(per-layer cost, per-step overhead) from five timed shapes: decode at two row counts and two
    KV lengths, and a prefill chunk at two starting positions. Solved feature by feature (fixed part
    from the two row counts, KV slope from the two lengths, prefill slopes given the fixed part);
    a slope that timing noise makes negative is taken as 0."""
    layer = _fit([p.work for p in (decode, decode_few_rows, decode_long_kv, prefill, prefill_late)],
                 [p.per_layer_s for p in (decode, decode_few_rows, decode_long_kv, prefill, prefill_late)], "pass")
    overhead = _fit([p.work for p in (decode, decode_few_rows, decode_long_kv, prefill, prefill_late)],
                    [max(0.0, p.one_layer_s - p.per_layer_s)
                     for p in (decode, decode_few_rows, decode_long_kv, prefill, prefill_late)], "step")
    return layer, overhead


def _fit(works: list[StepWork], times: list[float], fixed_per: str) -> LinearCost:
    dec, few, long_kv, pre, late = works
    t_dec, t_few, t_long, t_pre, t_late = times
    rows_apart = dec.decode_rows - few.decode_rows
    per_row_at_kv = (t_dec - t_few) / rows_apart if rows_apart > 0 else t_dec / max(dec.decode_rows, 1)
    fixed = t_dec - per_row_at_kv * dec.decode_rows
    if fixed < 0 or per_row_at_kv < 0:  # noise: all of it per row
        fixed, per_row_at_kv = 0.0, t_dec / max(dec.decode_rows, 1)
    kv_apart = long_kv.decode_kv - dec.decode_kv
    per_row_kv = max(0.0, (t_long - t_dec) / kv_apart) if kv_apart > 0 else 0.0
    per_row = max(0.0, per_row_at_kv - per_row_kv * dec.decode_kv / max(dec.decode_rows, 1))
    ctx_apart = late.prefill_ctx - pre.prefill_ctx
    per_token_ctx = max(0.0, (t_late - t_pre) / ctx_apart) if ctx_apart > 0 else 0.0
    per_token = max(0.0, (t_pre - fixed - per_token_ctx * pre.prefill_ctx) / max(pre.prefill_tokens, 1))
    if fixed_per == "pass":
        return LinearCost(per_pass_s=fixed, per_row_s=per_row, per_row_kv_s=per_row_kv, per_token_s=per_token,
                          per_token_ctx_s=per_token_ctx)
    return LinearCost(per_step_s=fixed, per_row_s=per_row, per_row_kv_s=per_row_kv, per_token_s=per_token,
                      per_token_ctx_s=per_token_ctx)
