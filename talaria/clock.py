"""Injected clocks. Policies take a ``Clock`` instead of calling ``time`` so tests and the simulator can
drive them with a virtual clock."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic time line."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class WallClock:
    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to (unit tests, simulator)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError("time does not go backwards")
        self.t += dt
        return self.t
