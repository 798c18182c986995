"""The one exponentially weighted moving average of the project (Talaria §3.3: profiles "refreshed using an
exponentially weighted moving average"). Every measured cost — router profiles and call shapes, the engine's
step timings, switch costs by path, slot-scheduler costs, host KV restore costs — folds samples in with it."""

from __future__ import annotations


def ewma(old: float | None, sample: float, alpha: float) -> float:
    """One EWMA step: ``sample`` itself when there is no previous value (``old is None``)."""
    return sample if old is None else (1.0 - alpha) * old + alpha * sample


class Ewma:
    """A running EWMA; ``value`` is the prior until the first sample."""

    __slots__ = ("alpha", "value", "samples")

    def __init__(self, prior: float, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.value = prior
        self.samples = 0

    def add(self, x: float) -> float:
        """Mutates: ``value`` and ``samples``."""
        self.value = ewma(self.value if self.samples else None, x, self.alpha)
        self.samples += 1
        return self.value
