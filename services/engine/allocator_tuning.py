"""The engine process's C heap tuned for a forward pass that allocates the same large tensors every step.

Design note. A CPU forward allocates and frees its activations every step: at a 2,048-token prefill of
SmolLM2-135M, tensors of 2-12 MB per op (the MLP's ``[T, 3072]`` gate/up, ``[T, 576]`` residuals, RoPE
products). glibc's malloc serves blocks above its mmap threshold (dynamic, 128 KiB to 32 MiB) with fresh
``mmap``s and returns freed heap tops above its trim threshold to the kernel, so each step touches new
pages: measured here, 108,000 minor page faults per 2,048-token prefill on the executor thread (193,000 on
the main thread), each a kernel entry plus a zeroed 4 KiB page, ~15% of the prefill's CPU time. With
``mallopt`` set once at start (mmap threshold at glibc's maximum, 32 MiB; trim threshold 1 GiB; top pad 64
MiB) the same prefill faults 0 times: freed activations stay in the heap and the next step reuses them.
This is what the CPU backends of other engines get from swapping the allocator (vLLM's CPU guide preloads
tcmalloc); glibc's own knobs need no extra library. Cost: the engine keeps up to the trim threshold of freed
heap resident, a bounded amount next to its KV pool and weights. Not glibc (musl, macOS): nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest value it accepts
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def tune_allocator() -> bool:
    """Set the process-wide malloc knobs above (glibc only). Returns whether every one was accepted; logs
    one line either way. Mutates the process's allocator settings (for allocations made from now on)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("allocator tuning skipped: no glibc mallopt here")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(p, v) == 1 for p, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    log.info("allocator tuned for step-sized activations (mmap threshold %d MiB, trim %d MiB): %s",
             MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, "ok" if ok else "a setting was refused")
    return ok
