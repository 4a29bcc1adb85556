"""A stage's side of a re-plan that keeps caches (stages.replay): carrying the KV of kept layers into
the new span's arena, and replaying only the moved layers, gives what transformers computes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from layerbus.broker.replay_window import StageCaches, replay_window
from layerbus.models.model_files import open_model_dir
from layerbus.stages.forward import head_logits, run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.replay import CarryFrom, replay_step
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange
from tests.helpers.tiny_llama import ATOL, TINY, save_tiny_model, tokens

LAYERS = 4
LOADED_AS = ("model", "fp32")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    reference = save_tiny_model(LlamaConfig(**{**TINY, "num_hidden_layers": LAYERS}), path)
    return reference, open_model_dir(path)


class Stage:
    """A shard with its arena, run the way stages.worker runs a step (sent-on outputs kept)."""

    def __init__(self, files, span: LayerRange, carry: CarryFrom | None = None):
        self.shard = load_shard(files, ShardSpec(span, span.start == 0, span.end == LAYERS))
        config = self.shard.config
        self.arena = KVArena(list(span), 4, config.num_key_value_heads, config.head_dim, torch.float32,
                             torch.device("cpu"), 256, outputs_size=0 if span.end == LAYERS else config.hidden_size,
                             allocate=carry is None)
        self.kept = carry.into(self.arena, span) if carry is not None else None

    def run(self, rows: list[StepRow], inputs: torch.Tensor, window=None) -> torch.Tensor | None:
        if window is not None:
            return replay_step(self.shard, self.arena, rows, inputs, window)
        hidden = run_step(self.shard, self.arena, rows, inputs)
        if not self.shard.spec.is_last:
            self.arena.store_outputs([r.slot for r in rows], [r.start for r in rows], [r.length for r in rows],
                                     hidden, self.shard.spec.layers.end)
        return hidden

    def carry(self) -> CarryFrom:
        return CarryFrom.of(self.shard, self.arena, LOADED_AS, LOADED_AS)


def chain_step(stages: list[Stage], rows: list[StepRow], ids: list[int], window=None) -> torch.Tensor | None:
    data = torch.tensor(ids, dtype=torch.int64)
    for stage in stages:
        data = stage.run(rows, data if data is not None else torch.empty((0, TINY["hidden_size"])), window)
    return data


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_replaying_the_moved_layers_gives_transformers_logits(model, lost):
    reference, files = model
    spans = [LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4)]
    stages = [Stage(files, span) for span in spans]
    seqs = {0: tokens(11, 9), 2: tokens(12, 6)}
    # Prefill (slot 0 in two chunks) and two decode steps, through all three stages.
    chain_step(stages, [StepRow(0, 0, 5), StepRow(2, 0, 6)], seqs[0][:5] + seqs[2])
    chain_step(stages, [StepRow(0, 5, 4)], seqs[0][5:9])
    for extra in (31, 32):
        for slot in seqs:
            seqs[slot].append(extra + slot)
        chain_step(stages, [StepRow(0, 9 + extra - 31, 1), StepRow(2, 6 + extra - 31, 1)],
                   [seqs[0][-1], seqs[2][-1]])
    cached = {slot: len(seq) for slot, seq in seqs.items()}

    # One stage is lost: the two survivors split the four layers again.
    survivors = [stage for i, stage in enumerate(stages) if i != lost]
    new_spans = [LayerRange(0, 2), LayerRange(2, 4)]
    replanned = [Stage(files, span, stage.carry()) for stage, span in zip(survivors, new_spans)]
    window = replay_window(LAYERS, [StageCaches(s.shard.spec.layers, s.kept.kept, s.kept.outputs_at) for s in replanned])
    assert window is not None and window != LayerRange(0, LAYERS) or lost == 0
    rows = [StepRow(slot, 0, n) for slot, n in cached.items()]
    chain_step(replanned, rows, [t for slot in cached for t in seqs[slot]], (window.start, window.end))

    # The next token of each: the caches of every layer must be whole again.
    for slot in seqs:
        seqs[slot].append(40 + slot)
    hidden = chain_step(replanned, [StepRow(0, cached[0], 1, emit=True), StepRow(2, cached[2], 1, emit=True)],
                        [seqs[0][-1], seqs[2][-1]])
    logits = head_logits(replanned[-1].shard, hidden)
    with torch.no_grad():
        for row, slot in enumerate(seqs):
            want = reference(torch.tensor([seqs[slot]])).logits[0, -1].float()
            torch.testing.assert_close(logits[row], want, atol=ATOL, rtol=0)


def test_a_stage_without_the_outputs_a_replay_starts_from_refuses_it(model):
    _, files = model
    stage = Stage(files, LayerRange(1, 3))  # never carried anything
    with pytest.raises(ValueError, match="needs the hidden states this stage sent into it"):
        stage.run([StepRow(0, 0, 2)], torch.zeros((2, TINY["hidden_size"])), (2, 4))


def test_other_weights_carry_nothing(model):
    _, files = model
    stage = Stage(files, LayerRange(0, 2))
    assert CarryFrom.of(stage.shard, stage.arena, ("model", "fp32"), ("model", "int8")) is None
