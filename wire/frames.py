"""The wire format: one JSON header frame, then one raw frame per tensor.

Nothing that crosses a socket is ever unpickled: a header is parsed as JSON and checked field by
field, and each tensor is rebuilt with `torch.frombuffer` from its raw bytes after its announced
dtype, shape and byte count have been validated. That is the whole attack surface, in one file.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

# Received frames are read-only buffers; torch warns once when it wraps one. The tensors built here
# are only read (fed to layers or copied into caches), so the warning carries no information.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

WIRE_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # a header lists ids and small options; 1 MiB is far above any real one
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30  # an option per socket; this guards against a runaway sender
MAX_DIMENSION = 1 << 40  # far beyond any real tensor, and small enough that torch never overflows

# The dtypes that may travel, by their wire name. bfloat16 has no numpy equivalent, so every tensor
# travels as its raw bytes and is re-typed on arrival.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}


class WireError(ValueError):
    """A message that cannot be accepted: malformed, truncated, oversized or inconsistent."""


@dataclass(frozen=True)
class Message:
    """A decoded message: its header (kind, ids, options) and its named tensors."""

    header: dict[str, Any]  # the parsed JSON header, without the "tensors" list
    tensors: dict[str, torch.Tensor]  # name -> tensor, in the order they were sent

    @property
    def kind(self) -> str:
        return self.header["kind"]


def encode(header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> list[Any]:
    """Frames for `send_multipart(..., copy=False)`: the header, then each tensor's bytes.

    Contiguous CPU tensors are sent from their own memory (no copy); others are made contiguous
    (and moved to the CPU) first, which is the one copy the socket needs anyway.
    """
    tensors = tensors or {}
    specs = []
    frames: list[Any] = [b""]  # header placeholder, filled once the specs are known
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise WireError(f"tensor {name!r} has dtype {tensor.dtype}, which cannot travel; "
                            f"supported: {', '.join(WIRE_DTYPES)}")
        specs.append({"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)})
        frames.append(_tensor_bytes(tensor))
    full_header = dict(header, v=WIRE_VERSION, tensors=specs)
    frames[0] = json.dumps(full_header, separators=(",", ":")).encode()
    return frames


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    # Viewing as uint8 works for every dtype (bfloat16 included) and keeps the memory shared.
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def decode(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Parse and validate a multipart message; raises WireError saying what is wrong with it."""
    if not frames:
        raise WireError("empty message: no header frame")
    buffers = [_as_buffer(frame) for frame in frames]
    total = sum(len(buffer) for buffer in buffers)
    if total > max_message_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_message_bytes} bytes")
    header = _parse_header(buffers[0])
    specs = header.pop("tensors")
    if len(specs) != len(buffers) - 1:
        raise WireError(f"header announces {len(specs)} tensor frame(s) but {len(buffers) - 1} arrived "
                        "(truncated or padded message)")
    tensors = {}
    for spec, buffer in zip(specs, buffers[1:]):
        name, dtype, shape = _check_spec(spec)
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if len(buffer) != expected:
            raise WireError(f"tensor {name!r}: {dtype} {shape} needs {expected} bytes, frame has {len(buffer)}")
        if expected == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(buffer, dtype=dtype).reshape(shape)
    return Message(header=header, tensors=tensors)


def _as_buffer(frame: Any) -> memoryview:
    # zmq.Frame (copy=False) exposes .buffer; bytes and memoryviews are used as they are.
    buffer = getattr(frame, "buffer", frame)
    return memoryview(buffer).cast("B")


def _parse_header(buffer: memoryview) -> dict[str, Any]:
    if len(buffer) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(buffer)} bytes exceeds {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(bytes(buffer))
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WireError(f"header is not valid JSON: {type(error).__name__}: {error}"[:300]) from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a JSON object, got {type(header).__name__}")
    if type(header.get("v")) is not int or header["v"] != WIRE_VERSION:
        raise WireError(f"wire version {header.get('v')!r} is not {WIRE_VERSION}: "
                        "broker and stages must run the same layerbus version")
    if not isinstance(header.get("kind"), str):
        raise WireError("header has no string 'kind'")
    specs = header.get("tensors", [])
    if not isinstance(specs, list):
        raise WireError("header 'tensors' must be a list")
    header["tensors"] = specs
    return header


def _check_spec(spec: Any) -> tuple[str, torch.dtype, list[int]]:
    if not isinstance(spec, dict):
        raise WireError(f"tensor spec must be an object, got {spec!r:.80}")
    name, dtype_name, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str):
        raise WireError(f"tensor spec without a string name: {spec!r:.80}")
    if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:  # a list is unhashable: check first
        raise WireError(f"tensor {name!r}: unknown dtype {dtype_name!r}; supported: {', '.join(WIRE_DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(type(size) is int and 0 <= size <= MAX_DIMENSION for size in shape)):
        raise WireError(f"tensor {name!r}: shape must be a list of at most 8 non-negative ints, got {shape!r:.80} "
                        f"(each at most {MAX_DIMENSION})")
    return name, WIRE_DTYPES[dtype_name], shape
