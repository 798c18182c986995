"""The router's collector settings (``talaria/gctune.py``): frozen start-up objects, a raised young threshold,
and the block form the simulator uses gives the process its collector back."""

from __future__ import annotations

import gc

from talaria import gctune
from talaria.config import RouterConfig


def test_tuned_raises_the_young_threshold_freezes_and_restores():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    keep = [object() for _ in range(1000)]  # start-up objects: frozen by tune
    with gctune.tuned(12_345) as th:
        assert th[0] == 12_345 and gc.get_threshold()[1:] == before[1:]
        assert gc.get_freeze_count() >= frozen + len(keep)
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
    with gctune.tuned(0) as th:  # 0: Python's thresholds untouched
        assert th == before and gc.get_freeze_count() == frozen
    assert RouterConfig().gc_gen0_threshold == gctune.DEFAULT_GEN0 > 700
