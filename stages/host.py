"""What a stage checks and measures about the machine it runs on: that its device exists, and its own
resident memory (the figures a stage reports when it has loaded a span)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
from collections.abc import Iterator

import torch


def check_device(device: str, dtype: str) -> None:
    """Refuse at start-up a device this machine does not have, rather than at the first load."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a torch device; use cpu, cuda:N or mps") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: this torch build or machine has no CUDA device "
                             f"(torch {torch.__version__}); install a CUDA build of torch or use --device cpu")
        if (parsed.index or 0) >= count:
            raise ValueError(f"--device {device}: only {count} CUDA device(s) here (cuda:0 to cuda:{count - 1})")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps: Metal is not available on this machine; use --device cpu")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device}: layerbus runs on cpu, cuda:N or mps")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {dtype!r} is not float32, bfloat16 or float16")


def peak_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM belongs to the process's own address space;
    getrusage's ru_maxrss would also carry the high-water mark of the parent that forked us,
    which for a stage spawned by a process holding a model is that whole model."""
    peak = proc_kib_field("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: the best there is


def budget_overrun(peak_bytes: int, budget_bytes: int | None, before_load_bytes: int, weight_bytes: int) -> str | None:
    """What to say when a load's peak resident memory went over the stage's --memory-budget (None when it
    did not, or no budget was given). The planner placed the span to fit, so an overrun is memory it did
    not know of: the figures say where it went, and how much more budget would have held it."""
    if budget_bytes is None or peak_bytes <= budget_bytes:
        return None
    mib = 1 << 20
    rest = peak_bytes - before_load_bytes - weight_bytes
    return (f"peak resident memory {peak_bytes / mib:.0f} MiB is over the --memory-budget of {budget_bytes / mib:.0f} "
            f"MiB by {(peak_bytes - budget_bytes) / mib:.0f} MiB (before the load {before_load_bytes / mib:.0f} MiB, "
            f"weights {weight_bytes / mib:.0f} MiB, the rest {rest / mib:.0f} MiB: KV cache and the load's "
            f"temporaries); the planner counted on less. Give this stage at least {(peak_bytes - budget_bytes) / mib:.0f} "
            "MiB more --memory-budget, and report the figures: they show where the plan's memory model falls short")


def proc_kib_field(path: str, name: str) -> int | None:
    """A "Name:  N kB" field of a /proc file (status, meminfo) in bytes; None where there is none (not Linux)."""
    try:
        with open(path) as fields:
            for line in fields:
                if line.startswith(f"{name}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def release_freed_memory() -> None:
    """Give the heap's freed pages back to the system (glibc's malloc_trim), so what a stage freed (a
    profile's full-precision layers, an old span) stops counting in its resident memory. Once large
    tensors have been freed glibc serves the next ones up to 32 MB from its heap instead of fresh
    mappings and keeps their pages: after profiling a 1.28B model's first layers a stage sat 170 MB above
    its runtime, all of it counted against its --memory-budget. Nothing to do off glibc."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


# glibc's mallopt parameter, and the largest threshold its dynamic adjustment reaches on 64-bit
M_MMAP_THRESHOLD = -3
M_TRIM_THRESHOLD = -1
DYNAMIC_MMAP_THRESHOLD_MAX = 32 << 20
LOAD_MMAP_THRESHOLD = 1 << 20


@contextlib.contextmanager
def large_allocations_mapped() -> Iterator[None]:
    """While a span loads, every allocation of 1 MiB or more gets its own mapping, returned to the system
    when freed. Under glibc's default the threshold rises to the size of the last large block freed (a
    stored tensor read for quantizing, 23 MiB for the 1.28B model), so the next ones come from the heap,
    between the blocks that stay, and their freed space stays resident: a 1.28B int8 stage peaked 30-80
    MiB above its weights, KV cache and one stored tensor, varying from run to run (1107-1161 MiB under a
    1150 MiB --memory-budget); with this, 1075-1096 MiB every time. Afterwards the threshold is fixed at
    the ceiling the dynamic one would have reached, and so is the trim threshold (twice it, as glibc's
    dynamic rule sets it), so steps reuse heap memory as before. Setting one by mallopt freezes both: with
    the trim threshold left at its 128 KiB default, every tile a quantized layer dequantizes into (4 MiB)
    went back to the system when freed and faulted in again for the next, and an int4 decode step took
    3.4x as long (541 against 160 ms for 3 layers of the 1.28B model's shapes). Keeping it resident adds
    nothing to the peak: a step held it already. Off glibc, nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        yield
        return
    mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, DYNAMIC_MMAP_THRESHOLD_MAX)
        mallopt(M_TRIM_THRESHOLD, 2 * DYNAMIC_MMAP_THRESHOLD_MAX)


def reset_peak_rss() -> None:
    """Restart the peak from the current size (Linux >= 4.0), so a load's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


# In a stage forked from the launcher (launch/stage_forker.py): the launcher's resident memory when it
# forked. Linux copies no page table entries of file-backed mappings at fork, so the child's own
# resident figure starts lower (279 against 362 MB here) and grows as it touches the libraries' pages
# again; runtime_rss_bytes counts the launcher's figure instead, as a fresh interpreter would measure
# itself, so a --memory-budget still holds.
inherited_rss_bytes = 0


def runtime_rss_bytes() -> int:
    """What this process holds before any weight, as a fresh interpreter would measure it."""
    return max(current_rss_bytes(), inherited_rss_bytes)


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: the peak is the best figure there is
        return peak_rss_bytes()


def device_memory_bytes(device: str) -> int:
    """Memory this process holds on its GPU (what torch's allocator reserved there: a --memory-budget on a
    GPU counts it); 0 on a CPU, whose memory is the resident size."""
    kind = device.split(":", 1)[0]
    if kind == "cuda" and torch.cuda.is_initialized():  # never the heartbeat thread that initializes CUDA
        return int(torch.cuda.memory_reserved(torch.device(device)))
    if kind == "mps":
        return int(torch.mps.driver_allocated_memory())
    return 0
