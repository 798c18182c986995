"""torch's intra-op thread count, per thread, without its two traps.

The engine process should hold one OpenMP (libgomp) pool: the executor thread's team. Every other thread that
runs torch copies (the host KV tier's workers, the transfer scheduler) runs them single-threaded, because a
second pool puts more OpenMP threads in the process than it has cores, and libgomp then "throttles" every
team barrier (1,000 spins instead of ``GOMP_SPINCOUNT``, then sleep): the executor's decode ran at 0.7x
(services/engine/README.md, Threads). Two behaviours of ``torch.set_num_threads`` defeat a naive call:

1. It also sets the count of every thread that has not run an ATen parallel op yet: a thread started later
   that never sets its own inherits the *last* value anyone set.
2. ATen initialises a thread's count lazily, at its first parallel op (or ``get_num_threads``), *from that
   process-wide value*, replacing a count the thread had set before: a worker that calls
   ``set_num_threads(1)`` at start and runs its first copy after the executor set 2 runs with 2 threads,
   and starts a second pool.

:func:`set_thread_count` initialises the calling thread first, then sets its count, so it sticks whatever other
threads set later. Every thread that runs torch ops and wants its own count calls it.
"""

from __future__ import annotations

import torch


def set_thread_count(n: int) -> None:
    """Give the calling thread ``n`` intra-op threads, for good (see the module note). Mutates torch's count of
    the calling thread, and the default of threads that have not run an ATen parallel op yet."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    if torch.get_num_threads() != n:  # also ATen's lazy per-thread initialisation, which would undo a set before it
        torch.set_num_threads(n)
