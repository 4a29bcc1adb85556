"""Where a shard's blocks come from: quantized from full-precision tensors as they are read (`int8`,
`int4`) or the checkpoint's own blocks in the model directory's GGUF (`native`).

Both answer, per checkpoint tensor name, whether it is held in blocks and in which layout, and read it.
Quantizing on load packs only the decoder layers' projections (embeddings and the head keep the shard's
dtype); native packs whatever the GGUF stores in a layout layerbus reads, the embedding included.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from layerbus.models.compressed_tensors import CompressedBlocks
from layerbus.models.gguf_blocks import GGUFBlocks, model_gguf
from layerbus.models.model_files import ModelFiles, compressed_scheme
from layerbus.models.tensor_reader import SAFETENSORS_DTYPES, TensorReader
from layerbus.models.weight_blocks import Blocks, quantize_rows

_LAYER_LINEAR = re.compile(r"^model\.layers\.\d+\..+\.weight$")


class QuantizeOnLoad:
    """Decoder-layer projections quantized into `layout` as they are read, one tensor at a time."""

    def __init__(self, layout: str, reader: TensorReader):
        self.layout_name, self.reader = layout, reader

    def layout(self, name: str) -> str | None:
        return self.layout_name if _LAYER_LINEAR.match(name) else None

    def read(self, name: str) -> Blocks:
        # Read in its stored dtype (no conversion copy), quantized a chunk of rows at a time: the load
        # holds one stored tensor and a few MiB of float32 beside the blocks.
        stored = SAFETENSORS_DTYPES.get(self.reader.dtype_name(name))
        floating = stored is not None and stored.is_floating_point and stored != torch.float64
        weight = torch.empty(self.reader.shape(name), dtype=stored if floating else torch.float32)
        self.reader.read_into(name, weight)
        return quantize_rows(weight, self.layout_name)  # the stored tensor is freed on return


class NativeBlocks:
    """The checkpoint's own blocks, read from the GGUF kept in the model directory."""

    def __init__(self, gguf: Path, config):
        self.gguf = GGUFBlocks(gguf, config)

    def layout(self, name: str) -> str | None:
        return self.gguf.layout(name)

    def read(self, name: str) -> Blocks:
        return self.gguf.read(name)


def block_source(files: ModelFiles, quantize_to: str | None, native: bool, reader: TensorReader):
    """The source of a shard's blocks, or None when it holds every weight in full precision (native on a
    directory without a GGUF: the safetensors are the checkpoint's own format). A compressed-tensors
    checkpoint holds no full-precision projections: its own blocks, whatever --weights says."""
    quantization = getattr(files.config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    scheme = compressed_scheme({"quantization_config": quantization})
    if scheme is not None:
        return CompressedBlocks(reader, scheme)
    if quantize_to is not None:
        return QuantizeOnLoad(quantize_to, reader)
    gguf = model_gguf(files.path) if native else None
    return NativeBlocks(gguf, files.config) if gguf is not None else None


def to_device(blocks: Blocks, device: torch.device) -> Blocks:
    if device.type == "cpu":
        return blocks
    return Blocks(blocks.layout, blocks.d.to(device), None if blocks.m is None else blocks.m.to(device),
                  blocks.qs.to(device))
