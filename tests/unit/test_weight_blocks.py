"""GGUF blocks in torch against the gguf package's own quantize and dequantize, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize as gguf_dequantize, quantize as gguf_quantize

from layerbus.models.weight_blocks import LAYOUTS, dequantize, from_raw, quantize, quantize_rows

GGML_TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
              "q8_0": GGMLQuantizationType.Q8_0}


def _weight(rows: int = 24, cols: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(rows, cols, generator=generator) * 0.05
    weight[0, :32] = 0.0  # a block of zeros: d = 0, whose inverse must not be inf
    weight[1, 5] = 3.0  # an outlier in a block
    weight[2, 40] = -2.5  # a negative extreme (q4_0 maps the signed extreme to -8)
    return weight


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_quantize_gives_ggufs_bytes(layout):
    weight = _weight()
    reference = gguf_quantize(weight.numpy(), GGML_TYPES[layout])  # uint8 [rows, blocks * block_bytes]
    ours = quantize(weight, layout)
    again = from_raw(torch.from_numpy(reference.copy()), LAYOUTS[layout], *weight.shape)
    assert torch.equal(ours.d.view(torch.int16), again.d.view(torch.int16))
    assert torch.equal(ours.qs, again.qs)
    if again.m is not None:
        assert torch.equal(ours.m.view(torch.int16), again.m.view(torch.int16))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dequantize_is_ggufs_bit_for_bit(layout):
    weight = _weight()
    raw = gguf_quantize(weight.numpy(), GGML_TYPES[layout])
    expected = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, GGML_TYPES[layout]), dtype=np.float32))
    blocks = from_raw(torch.from_numpy(raw.copy()), LAYOUTS[layout], *weight.shape)
    got = dequantize(blocks)
    assert got.dtype == torch.float32 and got.shape == weight.shape
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(dequantize(blocks, slice(5, 11)), got[5:11])


@pytest.mark.parametrize("layout, bound", [("q8_0", 0.004), ("q4_1", 0.05), ("q4_0", 0.08)])
def test_blocks_hold_the_weight_within_the_format_s_step(layout, bound):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    blocks = quantize(weight, layout)
    assert (dequantize(blocks) - weight).abs().max() < bound
    bits = LAYOUTS[layout].block_bytes * 8 / 32
    assert blocks.nbytes() == weight.numel() * bits / 8


def test_cols_must_fill_whole_blocks():
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize(torch.zeros(4, 40), "q4_1")


def test_gguf_header_reader_agrees_with_gguf_s_reader(tmp_path):
    """read_tensor_infos (a lean header parser) finds what gguf.GGUFReader finds: names, shapes, types,
    absolute offsets, past metadata of every kind (a string array like a tokenizer's among them)."""
    from gguf import GGUFReader, GGUFWriter

    from layerbus.models.gguf_blocks import read_tensor_infos

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_bool("general.flag", True)
    weight = _weight(64, 96).numpy()
    for name, kind in (("blk.0.attn_q.weight", "q4_1"), ("blk.0.ffn_down.weight", "q8_0")):
        raw = gguf_quantize(weight, GGML_TYPES[kind])
        writer.add_tensor(name, raw, raw_dtype=GGML_TYPES[kind])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(96, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    architecture, infos = read_tensor_infos(path)
    reference = GGUFReader(path)
    assert architecture == "llama"
    assert infos == {t.name: (tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.data_offset))
                     for t in reference.tensors}
    assert infos["blk.0.attn_q.weight"][0] == (96, 64)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compiled_kernel_dequantizes_as_gguf_does(layout, tmp_path, monkeypatch):
    """The C kernel writes gguf's float32 values bit for bit (no fused multiply-add)."""
    from layerbus.stages import block_kernel

    monkeypatch.setenv("LAYERBUS_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(block_kernel, "_kernel", False)
    weight = _weight(40, 160)
    blocks = quantize(weight, layout)
    out = block_kernel.dequantize_rows(blocks, slice(5, 35))
    assert out is not None, "gcc is on this machine: the kernel builds"
    expected = torch.from_numpy(np.ascontiguousarray(
        gguf_dequantize(gguf_quantize(weight.numpy(), GGML_TYPES[layout]), GGML_TYPES[layout]), dtype=np.float32))
    assert torch.equal(out.view(torch.int32), expected[5:35].contiguous().view(torch.int32))
    assert list(tmp_path.glob("blocks-*.so")), "built into the kernel cache"


def test_without_a_compiler_torch_dequantizes(tmp_path, monkeypatch, caplog):
    from layerbus.stages import block_kernel

    monkeypatch.setattr(block_kernel, "_kernel", False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LAYERBUS_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level("WARNING"):
        assert block_kernel.dequantize_rows(quantize(_weight(), "q4_1"), slice(0, 4)) is None
    assert "torch ops dequantize" in caplog.text
    monkeypatch.setattr(block_kernel, "_kernel", False)


@pytest.mark.parametrize("layout", ["q8_0", "q4_1", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_a_chunk_of_rows_at_a_time_gives_the_same_blocks(layout, dtype):
    weight = (torch.randn(37, 96, generator=torch.Generator().manual_seed(3)) * 0.1).to(dtype)
    whole = quantize(weight.to(torch.float32), layout)
    chunked = quantize_rows(weight, layout, chunk_elements=5 * 96)  # 8 chunks, the last one short
    for name in ("d", "m", "qs"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("layout", ["q8_0", "q4_1"])
def test_tiles_dequantize_into_one_reused_buffer(layout, tmp_path, monkeypatch):
    """A projection split into several tiles computes each tile's matmul with its dequantized rows, and
    every tile is written into the thread's one buffer (no fresh allocation per tile, which the heap kept)."""
    from layerbus.stages import block_kernel, packed_linear

    monkeypatch.setenv("LAYERBUS_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(block_kernel, "_kernel", False)
    monkeypatch.setattr(packed_linear, "TILE_ELEMENTS", 16 * 64)  # 16 rows of 64 per tile: 4 tiles for 50 rows
    monkeypatch.setattr(packed_linear, "_tiles", packed_linear._TileBuffer())
    weight, bias = _weight(50, 64), torch.randn(50)
    blocks = quantize(weight, layout)
    linear = packed_linear.PackedLinear(64, 50, layout, torch.nn.Parameter(bias, requires_grad=False))
    linear.load_blocks(blocks)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        expected = torch.cat([torch.nn.functional.linear(x, dequantize(blocks, slice(start, start + 16)),
                                                         bias[start:start + 16]) for start in range(0, 50, 16)], -1)
        assert torch.equal(linear(x), expected)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, dequantize(blocks), bias))
        pointers = {linear._weight_rows(slice(start, min(start + 16, 50)), torch.float32).data_ptr()
                    for start in range(0, 50, 16)}
    assert block_kernel.load_kernel() is not None, "gcc is on this machine: the kernel builds"
    assert pointers == {packed_linear._tiles.buffer.data_ptr()}
