"""Which layers a re-plan must recompute, given what each stage kept (pure; table tests in
tests/unit/test_replay_window.py).

After a lost or slowed stage, the broker re-plans and every stage loads its new span. A stage that
held some of its new layers before keeps their caches (stages.replay), and reports which in READY
(`kept`), with the layer its kept outputs enter (`outputs_at`: the hidden states it sent on, which
are the input of the layer that followed its old span). The layers nobody kept ("moved") must be
recomputed for every cached position of every active sequence; so must every layer between them,
since each layer's input is the previous one's output.

The window starts at the first moved layer if the hidden states entering it were kept, else at the
nearest earlier layer whose input was kept, else at layer 0 (the tokens). It ends after the last
moved layer. A stage lost from the middle of three equal stages thus costs a replay of a third of
the layers, where recomputing every layer on every stage cost three times that.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerbus.wire.spans import LayerRange


@dataclass(frozen=True)
class StageCaches:
    """One stage of the new chain: its new span, what it kept of its caches, where its outputs enter."""

    span: LayerRange
    kept: LayerRange | None = None
    outputs_at: int | None = None


def replay_window(num_layers: int, chain: list[StageCaches]) -> LayerRange | None:
    """The layers [w0, w1) to replay over every cached position; None when every layer's caches were
    kept (nothing to recompute). LayerRange(0, num_layers) means every layer: nothing was kept that helps."""
    kept = [False] * num_layers
    for stage in chain:
        if stage.kept is None:
            continue
        # Only what the stage holds again counts (a report past its span is not trusted).
        for layer in range(max(stage.kept.start, stage.span.start), min(stage.kept.end, stage.span.end)):
            kept[layer] = True
    moved = [layer for layer in range(num_layers) if not kept[layer]]
    if not moved:
        return None
    first, end = moved[0], moved[-1] + 1
    start = first
    while start > 0 and not _input_kept(chain, start):
        start -= 1
    return LayerRange(start, end)


def _input_kept(chain: list[StageCaches], layer: int) -> bool:
    """Whether the hidden states entering `layer` are kept where the replay can start from them: by the
    stage whose new span runs up to the layer or past it (it computes from them, or sends them on)."""
    holder = next((s for s in chain if s.span.start < layer <= s.span.end), None)
    return holder is not None and holder.outputs_at == layer
