"""How much memory a hot engine's KV pool gets when the config does not say (``engine.kv_cache_mb: null``).

Design note. A fixed default cannot fit both a 17 MB test model and a real one serving agent sessions: the
old 256 MiB held ~11K tokens of SmolLM2-135M (23 KiB of bf16 K+V per token), fewer than eight agent
sessions of 2-3K tokens, so the router's memory check answered 429 to a load any peer serves (vLLM's CPU
backend reserves a KV space of several GiB by default; its GPU backend takes a fraction of the device
memory left after the weights, ``gpu_memory_utilization``). The engine therefore sizes the pool from the
machine at start: on a CPU a quarter of the memory the kernel reports *available* (``MemAvailable``: free
plus reclaimable cache), capped at 4 GiB so that several engines and the kvstore fit on one host; on CUDA
half of the device memory free once the weights are loaded (the rest is activations, the allocator's
slack and other processes; untested here: no GPU). The executor then caps the pool at ``max_num_seqs``
full contexts, so a small model never reserves more than it can use. The pool is allocated (and zeroed)
at start, so what is chosen is resident: an explicit ``kv_cache_mb`` always wins.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

CPU_FRACTION = 0.25
CPU_CAP_BYTES = 4 << 30
CPU_FLOOR_BYTES = 256 << 20  # the old fixed default: never less than that when the machine has it
CUDA_FRACTION = 0.5


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of the host (Linux), else total physical memory (sysconf), else None. Reads only."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def cpu_kv_budget(available: int | None) -> int:
    """KV bytes for a CPU engine given the host's available memory (None: unknown => the floor). Pure."""
    if available is None or available <= 0:
        return CPU_FLOOR_BYTES
    return int(min(CPU_CAP_BYTES, max(min(CPU_FLOOR_BYTES, available // 2), available * CPU_FRACTION)))


def default_kv_cache_bytes(device) -> int:
    """The KV pool budget of a hot engine on ``device`` (a ``torch.device``) with no configured size; call it
    after the weights are on the device (CUDA counts what is free then). Reads the machine; mutates nothing."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FRACTION)
    return cpu_kv_budget(mem_available_bytes())
