"""The machine's speed at the moment a benchmark measures, recorded beside its numbers.

Design note. On a shared virtual machine the same work runs at different speeds in different sittings, and the
load average does not see it: the slowdown comes from outside the guest (co-tenants on the host's memory
bandwidth and caches), not from runnable processes here. Measured on the 2-core development VM: the agent
pattern run in-process (no server, identical work) took 23-24 s one day and 25-28 s another, 25.4 and 27.8 s in
two repetitions of one process; two sittings of the matrix's two-model replay moved the same configuration's engine
CPU by 25 % (services/router/README.md).
A benchmark that prints only its ratios and the load average cannot tell such a sitting from a regression.

``probe`` measures, in the benchmark's own process, the two rates a CPU engine's steps are bound by: a bf16
matrix multiply shaped like a small model's prefill linears (GFLOP/s; prefill runs at this rate) and a
streaming read of a buffer far larger than the last-level cache (GB/s; decode's weight and KV reads run at
this rate), each the median of a few short timings, plus the load average and the CPU time the hypervisor
reports as stolen since boot. It takes ~0.5 s and is meant to run between repetitions while the servers
under test are idle, never inside a measured window; the benchmarks record one sample per repetition and
print them beside the ratios, so a repetition's numbers can be read against the speed the machine had.
What it does not do: normalise anything. The ratios stay raw; the samples say how far to trust them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench import median
from bench.stats import loadavg

GEMM_SHAPE = (256, 576, 1536)  # tokens x hidden x MLP width: SmolLM2-135M's up projection at a 256-token chunk
READ_MB = 256  # well past any last-level cache here (32 MiB)


def _median_rate(fn, work: float, timings: int, iters: int) -> float:
    """``work`` units per second of ``fn`` run ``iters`` times, the median over ``timings`` timings."""
    rates = []
    for _ in range(timings):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rates.append(work * iters / (time.perf_counter() - t0))
    return median(rates)


def steal_seconds(path: str | Path = "/proc/stat") -> float | None:
    """CPU seconds the hypervisor ran someone else on this guest's CPUs since boot (``steal`` of the ``cpu`` line;
    None where the file or the field is missing). Some hypervisors never report it: 0 is not proof of none."""
    try:
        fields = Path(path).read_text().split("\n", 1)[0].split()
        return int(fields[8]) / 100.0  # USER_HZ is 100 on Linux
    except (OSError, ValueError, IndexError):
        return None


def probe(*, threads: int | None = None, timings: int = 5, read_mb: int = READ_MB) -> dict[str, Any]:
    """One sample of the machine's speed (see the module doc): ``gemm_gflops``, ``read_gb_s``, ``loadavg``
    (1/5/15 min), ``steal_s`` (since boot), ``threads`` and ``at`` (Unix time). Runs torch with ``threads``
    compute threads (default: torch's current setting) and restores the setting; allocates ``read_mb`` MiB for
    the duration of the call. Mutates nothing else."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        m, k, n = GEMM_SHAPE
        a = torch.randn(m, k).to(torch.bfloat16)
        b = torch.randn(k, n).to(torch.bfloat16)
        torch.matmul(a, b)  # first call: kernel selection, not timed
        gemm = _median_rate(lambda: torch.matmul(a, b), 2.0 * m * k * n / 1e9, timings, 20)
        buf = torch.ones(read_mb << 18, dtype=torch.float32)  # read_mb MiB, faulted in here, not in the timing
        buf.sum()
        read = _median_rate(buf.sum, buf.numel() * 4 / 1e9, timings, 2)
        del buf
        return {"gemm_gflops": round(gemm, 1), "read_gb_s": round(read, 2), "loadavg": loadavg(),
                "steal_s": steal_seconds(), "threads": torch.get_num_threads(), "at": time.time()}
    finally:
        torch.set_num_threads(before)


def render_samples(samples: list[dict[str, Any]]) -> str:
    """One line for a report: the samples' rates per repetition and their spread (max / min), or why none."""
    got = [s for s in samples if s]
    if not got:
        return "machine speed: not probed (--no-probe)"
    gemm = [s["gemm_gflops"] for s in got]
    read = [s["read_gb_s"] for s in got]
    load = [f"{s['loadavg'][0]:.2f}" if s.get("loadavg") else "n/a" for s in got]
    steal = [s.get("steal_s") for s in got]
    stolen = f"; CPU stolen by the host during the sitting {steal[-1] - steal[0]:.1f} s" if None not in steal and len(got) > 1 else ""
    return (f"machine speed per repetition (probed before each, servers idle): bf16 GEMM "
            f"{' / '.join(f'{g:.0f}' for g in gemm)} GFLOP/s (spread {max(gemm) / min(gemm):.2f}x), streaming read "
            f"{' / '.join(f'{r:.1f}' for r in read)} GB/s (spread {max(read) / min(read):.2f}x); load 1m {' / '.join(load)}{stolen}")
