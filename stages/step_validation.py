"""Checking a step message before a stage touches it: pure, so the fuzz tests drive exactly what a
stage runs (tests/unit/test_wire_fuzz.py).

Everything a stage accepts from its data port passes here: the frames' structure (wire.frames),
the step's header fields, the tensor this stage takes (token ids on the first stage, hidden states
decoded by the codec the sender announced elsewhere) and the rows, which must cover the tensor
exactly. Anything else is a WireError naming what is wrong; nothing is computed before it passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from layerbus.wire import codecs, protocol
from layerbus.wire.frames import Message, WireError, decode
from layerbus.wire.sampling import row_drafts

STEP_FIELDS = {"mb": int, "step": int, "attempt": int, "epoch": int, "rows": list, "release": list}


@dataclass(frozen=True)
class StepExpectations:
    """What this stage accepts: its position, width and epoch, and the message size limit."""

    is_first: bool  # takes token ids ("tokens", int64 [N]); others take "hidden" [N, hidden_size]
    hidden_size: int
    epoch: int
    max_message_bytes: int


def validate_step(frames, expect: StepExpectations) -> tuple[Message, float]:
    """The step in `frames`, its tensor decoded and its rows parsed (header["parsed_rows"]), and the
    seconds spent decoding the codec; WireError when anything does not hold."""
    message = decode(frames, expect.max_message_bytes)
    if message.kind != protocol.STEP:
        raise WireError(f"data message of kind {message.kind!r}; stages accept only {protocol.STEP!r}")
    protocol.require_fields(message.header, "step", STEP_FIELDS)
    if message.header["epoch"] != expect.epoch:
        raise WireError(f"step of epoch {message.header['epoch']} but this stage serves epoch {expect.epoch}")
    name = "tokens" if expect.is_first else "hidden"
    window = protocol.window_from_json(message.header.get("window"))
    message.header["parsed_window"] = window
    codec_s = 0.0
    if name == "hidden" and (message.tensors or window is None):
        started = time.monotonic()
        hidden = codecs.unpack(name, message.header, message.tensors)  # whatever codec the sender announced
        codec_s = time.monotonic() - started
        message.tensors.clear()
        message.tensors[name] = hidden
    if window is not None and not message.tensors:
        # A replay step this stage may have nothing to take from the one before (stages.replay): the
        # rows alone, with an empty tensor in place of the one it would carry.
        empty = torch.empty((0,), dtype=torch.int64) if name == "tokens" else torch.empty((0, expect.hidden_size))
        message.tensors[name] = empty
    tensor = message.tensors.get(name)
    if tensor is None or len(message.tensors) != 1:
        raise WireError(f"step for this stage must carry exactly one tensor {name!r}, got {list(message.tensors)}")
    if name == "tokens" and (tensor.dtype != torch.int64 or tensor.dim() != 1):
        raise WireError(f"'tokens' must be int64 [N], got {tensor.dtype} {list(tensor.shape)}")
    if name == "hidden" and (tensor.dim() != 2 or tensor.shape[1] != expect.hidden_size):
        raise WireError(f"'hidden' must be [N, {expect.hidden_size}], got {list(tensor.shape)}")
    # The parsed rows travel beside the header; the header keeps the rows as they arrived, so a
    # middle stage forwards them without encoding them again.
    message.header["parsed_rows"] = protocol.rows_from_json(message.header["rows"])
    message.header["parsed_prefix"] = protocol.prefix_ops_from_json(message.header.get("prefix"),
                                                                    message.header["parsed_rows"])
    for row in message.header["parsed_rows"]:
        try:
            if row_drafts(row.sampling, row.length) and not row.emit:
                raise ValueError("a row with drafts must emit: its drafts are verified where it picks its token")
        except ValueError as error:
            raise WireError(f"step row of slot {row.slot}: {error}") from None
    covered = sum(row.length for row in message.header["parsed_rows"])
    if covered != tensor.shape[0] and not (window is not None and tensor.shape[0] == 0):
        raise WireError(f"rows cover {covered} positions, tensor has {tensor.shape[0]}")
    return message, codec_s
