"""A compiled CPU kernel that dequantizes rows of GGUF blocks into float32 in one pass.

PackedLinear multiplies one tile of dequantized rows at a time with torch's own float32 matmul, which
keeps every dot product as the float32 path computes it (so `native` stays token for token equal to the
float32 import). What the naive path spends is the unpacking: torch runs it as five passes over memory
(mask, shift, concatenate, multiply, add), costing as much as the multiply. This kernel does it in one
pass in plain C, compiled on first use with the system's C compiler into a cache folder (no torch headers,
so it builds in under a second) and called through ctypes. It computes exactly what gguf's dequantize
does: -ffp-contract=off keeps `d * q + m` two roundings, as numpy's are, never one fused multiply-add.

Without a compiler (or when the build fails) the torch path runs, and one log line says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from layerbus.models.home import home_path
from layerbus.models.weight_blocks import BLOCK, Blocks

log = logging.getLogger("layerbus.stage")

SOURCE = r"""
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
/* 32 quants of one block -> four vectors of 8 floats, element order 0..31 (ggml's nibble order). */
static inline void nibbles(const uint8_t *q, __m256 out[4]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
}
#endif
/* rows x blocks of 32 weights; d and m already float32; out is [rows, blocks * 32]. Each value is
   d * q (+ m) with one rounding per operation, as gguf's numpy reference computes it. */
void dequant_q4_1(const float *restrict d, const float *restrict m, const uint8_t *restrict qs,
                  float *restrict out, int64_t n_blocks) {
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *q = qs + b * 16;
        float *o = out + b * 32;
#ifdef __AVX2__
        __m256 v[4], scale = _mm256_set1_ps(d[b]), low = _mm256_set1_ps(m[b]);
        nibbles(q, v);
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(o + 8 * k, _mm256_add_ps(_mm256_mul_ps(scale, v[k]), low));
#else
        for (int j = 0; j < 16; j++) {
            o[j] = d[b] * (float)(q[j] & 0x0F) + m[b];
            o[j + 16] = d[b] * (float)(q[j] >> 4) + m[b];
        }
#endif
    }
}
void dequant_q4_0(const float *restrict d, const uint8_t *restrict qs, float *restrict out, int64_t n_blocks) {
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *q = qs + b * 16;
        float *o = out + b * 32;
#ifdef __AVX2__
        __m256 v[4], scale = _mm256_set1_ps(d[b]), eight = _mm256_set1_ps(8.0f);
        nibbles(q, v);  /* q - 8 is exact in float32, as it is in int8 */
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(scale, _mm256_sub_ps(v[k], eight)));
#else
        for (int j = 0; j < 16; j++) {
            o[j] = d[b] * (float)((int8_t)(q[j] & 0x0F) - 8);
            o[j + 16] = d[b] * (float)((int8_t)(q[j] >> 4) - 8);
        }
#endif
    }
}
void dequant_q8_0(const float *restrict d, const int8_t *restrict qs, float *restrict out, int64_t n_blocks) {
    for (int64_t b = 0; b < n_blocks; b++) {
        const int8_t *q = qs + b * 32;
        float *o = out + b * 32;
        for (int j = 0; j < 32; j++) o[j] = (float)q[j] * d[b];
    }
}
"""
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-march=native", "-shared", "-fPIC"]

_kernel: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable (torch path)


def kernel_dir(environ=os.environ) -> Path:
    """$LAYERBUS_KERNEL_CACHE, else $LAYERBUS_HOME/kernels."""
    given = environ.get("LAYERBUS_KERNEL_CACHE")
    return Path(given).expanduser() if given else home_path(environ) / "kernels"


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source, compiler flags and machine), or None."""
    global _kernel
    if _kernel is False:
        _kernel = _build_and_load()
    return _kernel


def _build_and_load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: quantized weights dequantize with torch ops (slower); install gcc "
                     "for the compiled block kernel")
        return None
    key = hashlib.sha256((SOURCE + " ".join(FLAGS) + _cpu_flags()).encode()).hexdigest()[:16]
    library = kernel_dir() / f"blocks-{key}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            source = Path(scratch) / "blocks.c"
            source.write_text(SOURCE)
            built = Path(scratch) / library.name
            try:
                result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], capture_output=True,
                                        text=True)
                failure = result.stderr.strip()[-500:] if result.returncode != 0 else None
            except OSError as error:  # CC names no program
                failure = str(error)
            if failure is not None:
                log.warning("building the block kernel with %s failed, so torch ops dequantize (slower): %s",
                            compiler, failure)
                return None
            os.replace(built, library)  # concurrent builders each rename a whole file
        log.info("built the block kernel into %s", library)
    kernel = ctypes.CDLL(str(library))
    for name in ("dequant_q4_1", "dequant_q4_0", "dequant_q8_0"):
        getattr(kernel, name).restype = None
    return kernel


def _cpu_flags() -> str:
    """-march=native code runs only where the CPU has the same features: they are part of the cache key."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), os.uname().machine)
    except OSError:
        return os.uname().machine


def dequantize_rows(blocks: Blocks, rows: slice, into: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows `rows` of the blocks dequantized to float32 [n, cols], or None when the kernel is unavailable
    or the blocks are not on the CPU (the caller then uses models.weight_blocks.dequantize). Written into
    the front of `into` (a contiguous float32 CPU tensor of at least n x cols elements) where given, else
    into a new tensor."""
    kernel = load_kernel()
    if kernel is None or blocks.d.device.type != "cpu":
        return None
    d = blocks.d[rows].to(torch.float32)  # 1/32 of the weights: cheap, and keeps the kernel free of fp16
    qs = blocks.qs[rows]
    shape = (d.shape[0], d.shape[1] * BLOCK)
    if into is None:
        out = torch.empty(shape)
    else:
        if into.dtype != torch.float32 or not into.is_contiguous() or into.numel() < shape[0] * shape[1]:
            raise ValueError(f"dequantize_rows: `into` must be a contiguous float32 tensor of at least "
                             f"{shape[0] * shape[1]} elements, got {into.dtype} {tuple(into.shape)}")
        out = into.view(-1)[:shape[0] * shape[1]].view(shape)
    n_blocks = ctypes.c_int64(d.numel())
    pointer = ctypes.c_void_p
    if blocks.layout.name == "q4_1":
        m = blocks.m[rows].to(torch.float32)
        kernel.dequant_q4_1(pointer(d.data_ptr()), pointer(m.data_ptr()), pointer(qs.data_ptr()),
                            pointer(out.data_ptr()), n_blocks)
    elif blocks.layout.name == "q4_0":
        kernel.dequant_q4_0(pointer(d.data_ptr()), pointer(qs.data_ptr()), pointer(out.data_ptr()), n_blocks)
    else:
        kernel.dequant_q8_0(pointer(d.data_ptr()), pointer(qs.data_ptr()), pointer(out.data_ptr()), n_blocks)
    return out
