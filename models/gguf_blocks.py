"""A model directory's GGUF file, read tensor by tensor as its own blocks (for `--weights native`).

A directory imported from a GGUF keeps the file beside the float32 safetensors (models.default_model
does), so a stage can hold the checkpoint's own Q4_0/Q4_1/Q8_0 blocks instead of their float32 import.
Only tensor names, types and offsets are read up front; each tensor's bytes are read with one plain
`readinto` when its stage loads it, so a stage reads only its own layers.

Names follow transformers' GGUF loader (llama's layout), and so does its one transformation of the
weights: attn_q and attn_k rows come out of llama.cpp's converter permuted for its RoPE, and
transformers permutes them back. A permutation of whole rows moves whole blocks, so it is applied
to the blocks and the dequantized weights equal the float32 import's exactly.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from layerbus.models.model_files import ModelDirError
from layerbus.models.weight_blocks import BLOCK, LAYOUT_BY_GGML_TYPE, Blocks, from_raw

# Hugging Face name inside a decoder layer -> GGUF name inside blk.N (llama's layout).
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}


@dataclass(frozen=True)
class GGUFTensor:
    layout_name: str  # "q4_0", "q4_1" or "q8_0"
    rows: int
    cols: int
    offset: int  # absolute byte offset of its data in the file
    n_bytes: int


class GGUFBlocks:
    """The block tensors of one GGUF file, by their Hugging Face names."""

    def __init__(self, path: Path, config):
        self.path, self.config = Path(path), config
        architecture, infos = read_tensor_infos(self.path)
        if architecture != "llama":
            raise ModelDirError(f"{path}: --weights native reads llama-layout GGUFs, this one is {architecture!r}; "
                                "use --weights fp32 (its float32 import) or int8/int4")
        self.tensors: dict[str, GGUFTensor] = {}
        for name, (shape, ggml_type, offset) in infos.items():
            layout = LAYOUT_BY_GGML_TYPE.get(ggml_type)
            if layout is not None and len(shape) == 2:
                cols, rows = shape  # ggml lists the fastest dimension first
                self.tensors[name] = GGUFTensor(layout.name, rows, cols, offset,
                                                rows * cols // BLOCK * layout.block_bytes)

    def layout(self, hf_name: str) -> str | None:
        """The block layout `hf_name` is stored in, or None when it is not in blocks this reader knows."""
        tensor = self.tensors.get(_gguf_name(hf_name) or "")
        return tensor.layout_name if tensor else None

    def block_bytes(self, hf_name: str) -> int:
        """Bytes its blocks take once read (a GGUF block is d [+ m] + quants, as Blocks holds them)."""
        return self.tensors[_gguf_name(hf_name)].n_bytes

    def read(self, hf_name: str) -> Blocks:
        """The tensor's blocks, rows in the order the float32 import has them."""
        tensor = self.tensors[_gguf_name(hf_name)]
        layout = LAYOUT_BY_GGML_TYPE_NAME[tensor.layout_name]
        if tensor.cols % BLOCK:
            raise ModelDirError(f"{self.path}: {hf_name} has {tensor.cols} columns, not whole blocks of {BLOCK}")
        raw = torch.empty(tensor.n_bytes, dtype=torch.uint8)
        with open(self.path, "rb") as handle:
            handle.seek(tensor.offset)
            if handle.readinto(memoryview(raw.numpy())) != tensor.n_bytes:
                raise ModelDirError(f"{self.path} ends inside {hf_name}: the file is truncated")
        raw = raw.reshape(tensor.rows, -1)
        heads = self._permuted_heads(hf_name)
        if heads:
            raw = _reverse_permute_rows(raw, heads)
        return from_raw(raw, layout, tensor.rows, tensor.cols)

    def _permuted_heads(self, hf_name: str) -> int | None:
        if hf_name.endswith("self_attn.q_proj.weight"):
            return self.config.num_attention_heads
        if hf_name.endswith("self_attn.k_proj.weight"):
            return self.config.num_key_value_heads
        return None


LAYOUT_BY_GGML_TYPE_NAME = {layout.name: layout for layout in LAYOUT_BY_GGML_TYPE.values()}


def _gguf_name(hf_name: str) -> str | None:
    if hf_name in _TOP:
        return _TOP[hf_name]
    match = _LAYER.match(hf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"blk.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def _reverse_permute_rows(raw: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' _reverse_permute_weights on the rows of a [rows, bytes per row] block tensor."""
    rows = raw.shape[0]
    half = rows // heads // 2
    return raw.reshape(heads, half, 2, -1).transpose(1, 2).reshape(rows, -1).contiguous()


def model_gguf(path: Path) -> Path | None:
    """The one .gguf file in a model directory, or None."""
    found = sorted(Path(path).glob("*.gguf"))
    return found[0] if len(found) == 1 else None


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of a scalar; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_tensor_infos(path: Path) -> tuple[str, dict[str, tuple[tuple[int, ...], int, int]]]:
    """The GGUF's architecture and, per tensor, (shape as ggml lists it, ggml type, absolute data offset).

    Reads only the header. gguf's GGUFReader parses every metadata array into numpy views (the
    tokenizer's 49152 strings among them), which took 6 s here, for each stage that loads.
    """
    with open(path, "rb") as handle:
        data = _Header(handle)
        if data.take(4) != b"GGUF":
            raise ModelDirError(f"{path} is not a GGUF file")
        version, tensor_count, kv_count = data.unpack("<IQQ")
        if version < 2:
            raise ModelDirError(f"{path}: GGUF version {version} is too old; convert it again with llama.cpp")
        metadata = {}
        for _ in range(kv_count):
            key = data.string()
            value = data.value(data.unpack("<I")[0])
            if key in ("general.architecture", "general.alignment"):
                metadata[key] = value
        infos = {}
        for _ in range(tensor_count):
            name = data.string()
            (dims,) = data.unpack("<I")
            shape = data.unpack(f"<{dims}Q")
            ggml_type, offset = data.unpack("<IQ")
            infos[name] = (tuple(shape), ggml_type, offset)
        alignment = int(metadata.get("general.alignment", 32))
        start = -(-data.position // alignment) * alignment
    architecture = metadata.get("general.architecture", "?")
    return architecture, {name: (shape, kind, start + offset) for name, (shape, kind, offset) in infos.items()}


class _Header:
    """Sequential little-endian reads from a GGUF header, from memory read ahead in large chunks (a
    tokenizer's metadata is ~10^5 small strings; one file read each took seconds)."""

    def __init__(self, handle):
        self.handle, self.position, self.buffer = handle, 0, b""

    def take(self, count: int) -> bytes:
        end = self.position + count
        if end > len(self.buffer):
            self.buffer += self.handle.read(max(end - len(self.buffer), 4 << 20))
            if end > len(self.buffer):
                raise ModelDirError(f"{self.handle.name} ends inside its header: the file is truncated")
        chunk = self.buffer[self.position:end]
        self.position = end
        return chunk

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack("<" + _SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind in _SCALARS:  # skipped whole: no metadata array is needed here
                self.take(count * struct.calcsize("<" + _SCALARS[item_kind]))
                return None
            for _ in range(count):
                self.value(item_kind)
            return None
        raise ModelDirError(f"{self.handle.name}: unknown GGUF metadata type {kind}; is the file damaged?")
