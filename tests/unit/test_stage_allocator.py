"""The allocator settings a stage runs its steps under (stages/host.large_allocations_mapped): after a span's
load, a tile freed and allocated again every projection (what a quantized layer dequantizes into, 4 MiB)
stays in the heap instead of going back to the system and faulting in again. Counted in page faults, not
timed: in a fresh interpreter, as a stage is."""

from __future__ import annotations

import subprocess
import sys

TILE_FLOATS = 1 << 20  # stages/packed_linear.TILE_ELEMENTS: a 4 MiB float32 tile
ROUNDS = 40

SCRIPT = f"""
import ctypes, resource, sys
from layerbus.stages.host import large_allocations_mapped
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "load":
    with large_allocations_mapped():
        pass
size = {TILE_FLOATS} * 4
first = libc.malloc(size)  # the first one faults in wherever it lands
ctypes.memset(first, 1, size)
libc.free(first)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS}):
    tile = libc.malloc(size)
    ctypes.memset(tile, 1, size)  # touch every page, as the kernel writing a tile does
    libc.free(tile)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def test_tiles_freed_after_a_span_load_are_reused_not_faulted_in_again():
    pages_per_tile = TILE_FLOATS * 4 // 4096
    # Faulting every tile in again would be ROUNDS x 1024 faults (40,960); reuse costs next to none.
    assert page_faults("load") < ROUNDS * pages_per_tile // 10
    assert page_faults("none") < ROUNDS * pages_per_tile // 10  # and glibc's own dynamic rule, for comparison
