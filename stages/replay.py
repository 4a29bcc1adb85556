"""A stage's side of a re-plan that keeps caches: carry the KV of the layers it still holds into the
new span's arena, then run the broker's replay steps over the moved layers only.

When a stage is lost (or slowed), the broker re-plans and every stage loads its new span. Without
this, every stage then recomputes every position of every active sequence over all its layers. With
it, each stage keeps the keys and values of the layers it held before and holds again, and the
broker replays only a window of layers [w0, w1) that covers the ones that moved
(broker.replay_window). The stage where the window begins does not recompute the layers before it:
it starts from the hidden states it sent on before the re-plan, which it kept (kv_cache.KVArena's
outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerbus.stages.forward import run_step, shard_part
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.shard import StageShard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange


@dataclass(frozen=True)
class KeptCaches:
    """What a stage carried into its new span (reported in READY): the layers whose caches it kept,
    and the layer the hidden states it kept enter (None: it kept none, e.g. it was the last stage)."""

    kept: LayerRange | None
    outputs_at: int | None

    def to_json(self) -> dict:
        fields = {}
        if self.kept is not None:
            fields["kept"] = self.kept.to_json()
        if self.outputs_at is not None:
            fields["outputs_at"] = self.outputs_at
        return fields


@dataclass
class CarryFrom:
    """The old span's caches, waiting while the new span loads."""

    span: LayerRange
    was_last: bool
    arena: KVArena

    @staticmethod
    def of(shard: StageShard | None, arena: KVArena | None, loaded_as: tuple[str, str] | None,
           loading_as: tuple[str, str]) -> "CarryFrom | None":
        """The caches to carry, or None when there are none or they would not match the new span's
        computation: another model directory or weight format computes other keys."""
        if shard is None or arena is None or loaded_as != loading_as:
            return None
        return CarryFrom(shard.spec.layers, shard.spec.is_last, arena)

    def into(self, arena: KVArena, span: LayerRange) -> KeptCaches | None:
        """Move the caches of the layers both spans hold into `arena` (made with allocate=False: it is
        built at the old arena's capacity at once); None when its slots, heads or context differ from
        the old arena's (it is then allocated empty, and the broker replays every layer)."""
        if not arena.compatible(self.arena):
            arena.allocate()
            return None
        start, end = max(span.start, self.span.start), min(span.end, self.span.end)
        kept = LayerRange(start, end) if start < end else None
        outputs_at = self.span.end if not self.was_last and self.arena.outputs_at == self.span.end else None
        arena.carry_from(self.arena, list(range(start, end)) if kept else [], outputs_at)
        return KeptCaches(kept, outputs_at)


def replay_step(shard: StageShard, arena: KVArena, rows: list[StepRow], inputs: torch.Tensor,
                window: tuple[int, int]) -> torch.Tensor | None:
    """Run a replay step over layers [w0, w1) of the model: this stage computes the part of its span
    inside the window, from its input (the tokens, or what the stage before sent) where the window
    reaches its first layer, else from the hidden states it kept. Returns what to send on, or None
    when the window does not reach the next stage (nothing to carry)."""
    held = shard.spec.layers
    w0, w1 = window
    start, end = max(held.start, w0), min(held.end, w1)
    slots, starts, lengths = [r.slot for r in rows], [r.start for r in rows], [r.length for r in rows]
    if start >= end:
        if held.end == w0 and not shard.spec.is_last:  # the window begins at the next stage: send it what we kept
            _check_kept(arena, w0)
            return arena.stored_outputs(slots, starts, lengths) if rows else None
        return None
    if start == held.start:
        if inputs.shape[0] != sum(lengths):
            raise ValueError(f"replay step for layers [{w0}, {w1}) carries {inputs.shape[0]} positions for "
                             f"this stage's first layer {start}, its rows add up to {sum(lengths)}")
        source = inputs
    else:
        _check_kept(arena, start)
        source = arena.stored_outputs(slots, starts, lengths)
    hidden = run_step(shard_part(shard, start, end), arena, rows, source)
    if end < held.end:
        return None  # the window ends inside this span
    if not shard.spec.is_last:
        arena.store_outputs(slots, starts, lengths, hidden, end)
    return hidden


def _check_kept(arena: KVArena, layer: int) -> None:
    kept = arena.carried_outputs_at
    if kept != layer:
        raise ValueError(f"a replay from layer {layer} needs the hidden states this stage sent into it, but it "
                         f"kept {'none' if kept is None else f'those entering layer {kept}'}")
