"""A step plan in the wire's terms: the rows the stages read and the token ids the first stage embeds.

Only the last stage reads a row's sampling fields: the item's sampling parameters, a constrained row's token
masks, how many top log-probs to return, and a decode row's drafts to verify (wire/sampling.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from layerbus.wire.constraint import MASK_KEY, pack_mask
from layerbus.wire.protocol import StepRow
from layerbus.wire.sampling import DRAFT_KEY, DRAFT_MASKS_KEY, TOP_LOGPROBS_KEY

if TYPE_CHECKING:
    from layerbus.broker.scheduler import Scheduler
    from layerbus.broker.sequences import StepPlan


def step_rows(scheduler: Scheduler, plan: StepPlan) -> tuple[list[StepRow], list[int]]:
    """The plan's rows as the stages read them, and the token ids of every position in row order."""
    rows, tokens = [], []
    for row in plan.rows:
        request = scheduler.active[row.slot].request
        sampling = request.sampling.to_json() if row.emit else {}  # only emitting rows sample
        mask = scheduler.token_mask(row.slot) if row.emit and request.constraint is not None else None
        if mask is not None:  # the grammar's allowed next tokens: the last stage masks its logits with them
            sampling = {**sampling, MASK_KEY: pack_mask(mask)}
        if row.emit and request.want_logprobs and request.top_logprobs:
            sampling = {**sampling, TOP_LOGPROBS_KEY: request.top_logprobs}
        if row.drafts:
            sampling = {**sampling, DRAFT_KEY: list(row.tokens[1:])}
            if mask is not None:
                sampling[DRAFT_MASKS_KEY] = [pack_mask(m) for m in row.draft_masks]
        rows.append(StepRow(row.slot, row.start, len(row.tokens), row.emit, sampling, row.targets))
        tokens.extend(row.tokens)
    return rows, tokens
