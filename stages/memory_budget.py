"""A stage's memory budget as the planner gets it: what it may fill with weights, KV cache and
workspace, once its runtime and the loader's transient came out of what it has."""

from __future__ import annotations

import math
import os

import torch

from layerbus.models.tensor_reader import SAFETENSORS_DTYPES, TensorReader
from layerbus.stages.host import proc_kib_field


def memory_figures(files, device: str, given_budget: int | None, runtime_bytes: int,
                   emulate_memory: int | None = None) -> dict:
    """`memory_budget`: what the planner may fill with weights, KV cache and workspace, with what came
    out of it first. A --memory-budget is the stage's whole resident memory (what VmHWM reads), so
    on a CPU its runtime (interpreter, torch and the libraries, measured before anything was loaded:
    about 0.4 GiB) and the loader's transient (one tensor in its stored dtype, read before conversion)
    come out of it; without one the budget is the memory free now, which the runtime already occupies,
    so only the loader's transient does. On a GPU the budget is device memory: host memory is not
    part of it. An emulated memory (--emulate-memory) is the planner's budget as given."""
    loader = largest_tensor_bytes(files)
    on_cpu = torch.device(device).type == "cpu"
    if emulate_memory is not None:
        return {"memory_budget": emulate_memory, "memory_budget_given": None, "runtime_bytes": 0,
                "loader_peak_bytes": 0, "emulated_memory": True}
    if given_budget is None:
        usable = free_memory_bytes(device) - loader
    else:
        usable = given_budget - loader - (runtime_bytes if on_cpu else 0)
    return {"memory_budget": max(0, usable), "memory_budget_given": given_budget,
            "runtime_bytes": runtime_bytes if on_cpu else 0, "loader_peak_bytes": loader}


def largest_tensor_bytes(files) -> int:
    """The largest tensor of the checkpoint as stored: the loader's one temporary when it converts a
    dtype (models/tensor_reader.py reads everything else straight into its parameter)."""
    reader = TensorReader(files.tensor_files, files.path)
    largest = 0
    for name in files.tensor_files:
        stored = SAFETENSORS_DTYPES.get(reader.dtype_name(name))
        largest = max(largest, math.prod(reader.shape(name)) * (stored.itemsize if stored is not None else 4))
    return largest


def free_memory_bytes(device: str) -> int:
    """Memory this stage could fill now: free device memory on a GPU, available RAM on a CPU."""
    parsed = torch.device(device)
    if parsed.type == "cuda":
        return int(torch.cuda.mem_get_info(parsed)[0])
    if parsed.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    available = proc_kib_field("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
