"""Garbage-collector settings for a latency-sensitive service process (the router).

Design note
-----------
CPython's generational collector runs a young-generation collection every ``gen0`` net allocations (700
by default) and an older one every 10 of those. A placement decision at 1,000 instances allocates hundreds
of small objects (a cost breakdown per candidate), so with the default a collection lands inside a decision
every few decisions, and with a large heap the older generations' scans make it long: `talaria sim scale
--instances 1000 --models 100 --sessions 1000` measured the decision's p99 (thread CPU time) at 1.3-1.6 ms
with the default and 0.49-0.52 ms with collections 70x rarer or off, the decisions and every simulated
number identical (2026-12-05). The setting here: objects made during start-up move to the permanent
generation (``gc.freeze``: never scanned again) and the young threshold is raised, so collections are rare
and land in a small share of calls (they are then longer: the tail moves past p99; ``sim scale`` reports
p99.9 and the maximum beside p99). Memory: cyclic garbage waits for up to ``gen0`` allocations longer; the
router makes little of it (requests and breakdowns are freed by reference counting).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

DEFAULT_GEN0 = 50_000


def tune(gen0: int = DEFAULT_GEN0) -> tuple[int, int, int]:
    """Freeze what exists now and set the young-generation threshold to ``gen0`` (0: leave Python's
    defaults). Mutates the process's collector. Returns the thresholds in force."""
    if gen0 > 0:
        gc.collect()
        gc.freeze()
        _, g1, g2 = gc.get_threshold()
        gc.set_threshold(gen0, g1, g2)
    return gc.get_threshold()


@contextlib.contextmanager
def tuned(gen0: int = DEFAULT_GEN0) -> Iterator[tuple[int, int, int]]:
    """``tune`` for a block (the simulator runs the router in-process: ``sim scale``), then the previous
    thresholds and the frozen objects back in the collector's care."""
    before = gc.get_threshold()
    try:
        yield tune(gen0)
    finally:
        gc.set_threshold(*before)
        if gen0 > 0:
            gc.unfreeze()
