"""A packed step (stages.packing): every row in one pass over the layers, attention per row.

Table tests of the layout (order, decode runs, masks), then the numbers: a stage stepping through
a mix of prefill chunks, rewinds and decode rows must compute what `transformers` computes for each
sequence alone, for full and sliding-window attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerbus.models.attention_shape import attention_shape
from layerbus.models.model_files import open_model_dir
from layerbus.stages.forward import run_step
from layerbus.stages.kv_cache import KVArena
from layerbus.stages.packing import PackedLayout
from layerbus.stages.shard import ShardSpec, load_shard
from layerbus.wire.protocol import StepRow
from layerbus.wire.spans import LayerRange

CPU = torch.device("cpu")


def layout_of(spec: list[tuple[int, int, int]], windows=frozenset({None})) -> PackedLayout:
    return PackedLayout([StepRow(slot, start, length) for slot, start, length in spec], set(windows), CPU)


@pytest.mark.parametrize("spec, order, runs, chunks", [
    pytest.param([(0, 5, 1), (1, 9, 1), (2, 7, 1)], [0, 1, 2], [(0, 0, (6, 10, 8))], [],
                 id="adjacent decode slots: one run"),
    pytest.param([(2, 5, 1), (1, 0, 4), (0, 9, 1)], [2, 0, 1], [(0, 0, (10,)), (1, 2, (6,))], [(2, 1, 0, 4)],
                 id="decode rows first in slot order; a prefilling slot between them splits the run"),
    pytest.param([(0, 200, 1), (1, 10, 1), (2, 12, 1)], [0, 1, 2], [(0, 0, (201,)), (1, 1, (11, 13))], [],
                 id="a long row next to short ones: masking would waste too much, so apart"),
    pytest.param([(0, 30, 1), (1, 10, 1)], [0, 1], [(0, 0, (31, 11))], [],
                 id="short contexts: one run whatever the waste"),
    pytest.param([(4, 0, 3), (5, 8, 2)], [0, 1], [], [(0, 4, 0, 3), (3, 5, 8, 2)], id="chunks only, in step order"),
])
def test_layout(spec, order, runs, chunks) -> None:
    layout = layout_of(spec)
    assert layout.order == order
    assert [(run.offset, run.first_slot, run.lengths) for run in layout.runs] == runs
    assert [(c.offset, c.slot, c.start, c.length) for c in layout.chunks] == chunks
    positions = [p for i in order for p in range(spec[i][1], spec[i][1] + spec[i][2])]
    assert layout.positions.tolist() == [positions]


def test_gather_and_restore_are_inverse_permutations() -> None:
    spec = [(3, 0, 4), (1, 7, 1), (2, 0, 2), (0, 5, 1)]
    layout = layout_of(spec)
    values = torch.arange(sum(length for _, _, length in spec))
    packed = values.index_select(0, layout.gather)
    assert packed.tolist() == [7, 4, 0, 1, 2, 3, 5, 6]  # decode rows (slots 0, 1) first, then the chunks
    assert packed.index_select(0, layout.restore).tolist() == values.tolist()
    in_order = layout_of([(0, 5, 1), (1, 0, 3)])
    assert in_order.gather is None and in_order.restore is None, "already packed: no copies"


def test_masks() -> None:
    layout = layout_of([(0, 2, 1), (1, 4, 1), (2, 3, 3)], windows={None, 2})
    full, windowed = layout.run_masks[None][0], layout.run_masks[2][0]
    assert full[:, 0, 0].tolist() == [[True, True, True, False, False], [True] * 5]
    assert windowed[:, 0, 0].tolist() == [[False, True, True, False, False], [False, False, False, True, True]]
    chunk = layout.chunk_masks[None][0][0, 0]  # positions 3..5 over keys 0..5
    assert chunk.tolist() == [[True] * 4 + [False] * 2, [True] * 5 + [False], [True] * 6]
    assert layout_of([(0, 0, 4)]).chunk_masks[None] == [None], "a chunk from 0 without a window is plain causal"
    assert layout_of([(0, 2, 1), (1, 2, 1)]).run_masks[None] == [None], "equal lengths need no mask"


def _stage(model_dir) -> tuple:
    files = open_model_dir(model_dir)
    shard = load_shard(files, ShardSpec(LayerRange(0, files.num_layers), True, True))
    shape = attention_shape(shard.config)
    arena = KVArena(list(range(files.num_layers)), 4, shape.kv_heads, shape.head_dim, torch.float32, CPU, 256)
    return shard, arena


def _reference_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0]  # after the final norm, as the last stage returns it


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("mistral", {"sliding_window": 5}), ("qwen3", {})])
def test_mixed_steps_compute_what_transformers_computes(tiny_models, arch, overrides) -> None:
    model_dir = tiny_models(arch, **overrides)
    shard, arena = _stage(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(5, 100, (length,), generator=generator).tolist() for length in (17, 9, 12, 6)]
    # Each step: (slot, start, length). Slot 0 prefills in two chunks then decodes; slot 1 decodes beside
    # it; slot 2 prefills, is rewound to 4 (a recovery) and goes on; slot 3 arrives late.
    steps = [
        [(0, 0, 10), (1, 0, 8)],
        [(0, 10, 6), (1, 8, 1), (2, 0, 11)],
        [(0, 16, 1), (2, 4, 7), (3, 0, 5)],
        [(1, 8, 1), (0, 16, 1), (3, 5, 1), (2, 11, 1)],
    ]
    for step in steps:
        rows = [StepRow(slot, start, length) for slot, start, length in step]
        inputs = torch.tensor([t for slot, start, length in step for t in sequences[slot][start:start + length]])
        hidden = run_step(shard, arena, rows, inputs)
        offset = 0
        for slot, start, length in step:
            expected = _reference_hidden(model, sequences[slot][:start + length])[start:start + length]
            torch.testing.assert_close(hidden[offset:offset + length], expected, atol=2e-5, rtol=1e-4,
                                       msg=f"{arch}: slot {slot} positions {start}..{start + length}")
            offset += length
    assert arena.lengths == [17, 9, 12, 6]


def test_a_cuda_stage_leaves_cudnn_attention_out_and_a_cpu_stage_changes_nothing() -> None:
    """cuDNN's SDPA cost a stage 2 ms of CPU per call on an H200 (stages.attention); CPU stages keep torch's defaults."""
    from layerbus.stages.attention import prefer_low_overhead_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        prefer_low_overhead_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        prefer_low_overhead_attention(torch.device("cuda:0"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
