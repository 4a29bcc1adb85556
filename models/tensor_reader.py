"""Reading checkpoint tensors straight into the parameters that hold them.

A stage's memory budget is the point of splitting a model, so loading must not double it. Reading
through safetensors' memory map leaves every touched page counted in the process until the map
closes, and `get_tensor` makes a second copy before it is copied into the parameter: a span's load
peaked at about twice its size, and a last stage holding an untied head at its size plus two heads.
The safetensors layout is simple and stable (an 8-byte little-endian header length, a JSON header
of dtype, shape and byte offsets, then the raw data), so each tensor is read here with one plain
`readinto` into the destination's own memory; only a dtype change or a GPU destination goes
through one temporary tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from layerbus.models.model_files import ModelDirError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


class TensorReader:
    """Reads named tensors from a model's safetensors files into given tensors."""

    def __init__(self, tensor_files: dict[str, Path], model_path: Path):
        self.tensor_files = tensor_files
        self.model_path = model_path
        self.headers: dict[Path, tuple[dict, int]] = {}  # file -> (header, offset of its data)

    def has(self, name: str) -> bool:
        return name in self.tensor_files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def dtype_name(self, name: str) -> str:
        """The tensor's dtype as the file names it ("BF16", "F32", ...)."""
        return self._entry(name)[1]["dtype"]

    def read_into(self, name: str, target: torch.Tensor) -> None:
        """Fill `target` with checkpoint tensor `name` (shapes must match; dtypes are converted)."""
        path, entry, data_start = self._entry(name)
        shape = tuple(entry["shape"])
        if shape != tuple(target.shape):
            raise ModelDirError(f"{name} has shape {shape} in the checkpoint but the config implies "
                                f"{tuple(target.shape)}; config.json does not match the weights")
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelDirError(f"{path}: tensor {name} has dtype {entry['dtype']!r}, which layerbus cannot load "
                                f"(supported: {', '.join(SAFETENSORS_DTYPES)})")
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            raise ModelDirError(f"{path}: tensor {name} spans {end - begin} bytes, not what {entry['dtype']} "
                                f"{list(shape)} needs; the file is damaged")
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        destination = target if direct else torch.empty(shape, dtype=dtype)
        if destination.numel():
            with open(path, "rb") as handle:
                handle.seek(data_start + begin)
                buffer = memoryview(destination.reshape(-1).view(torch.uint8).numpy())
                if handle.readinto(buffer) != end - begin:
                    raise ModelDirError(f"{path} ends inside tensor {name}: the file is truncated; "
                                        "re-download or re-save the model")
        if not direct:
            target.copy_(destination)

    def _entry(self, name: str) -> tuple[Path, dict, int]:
        path = self.tensor_files.get(name)
        if path is None:
            raise ModelDirError(f"{self.model_path}: tensor {name} is missing from the checkpoint")
        if path not in self.headers:
            self.headers[path] = _read_header(path)
        header, data_start = self.headers[path]
        entry = header.get(name)
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise ModelDirError(f"{path}: no valid header entry for {name}; the file is damaged")
        return path, entry, data_start


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= _MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} is not plausible")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as error:  # json's errors are ValueErrors
        raise ModelDirError(f"{path} is not a readable safetensors file: {error}") from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{path} is not a readable safetensors file: its header is not an object")
    return header, 8 + length
