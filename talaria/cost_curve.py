"""Learned cost curves: a cost that depends on a size — prefill seconds per token by context
length, decode-step seconds by batch size — learned from measured steps, a cold-start prior only until then.

Design NOTE. Talaria §3.3/§3.4 price calls with profiled costs; one scalar per instance hides that a token
prefilled at position 3,000 attends over 20x more keys than one at 150, and that a decode step of 16
sequences costs more than one of 1. A :class:`CostCurve` keeps one EWMA (``talaria.ewma``) per power-of-two
bucket of the size; ``value(x)`` is the measured bucket's, else a log-linear interpolation between the
nearest measured buckets (flat beyond them), else the prior. The engine measures (executor step timing) and
publishes the buckets in its heartbeat (``CostProfile.prefill_by_context`` / ``decode_by_batch``); the
router's ``profiles.py`` and the slot scheduler's ``slots/costs.py`` read them through the same class.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from talaria.ewma import ewma

if TYPE_CHECKING:
    from talaria.v1 import engine_pb2 as pb


def bucket(x: float) -> int:
    """The bucket key of size ``x``: the smallest power of two >= x (>= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))


class CostCurve:
    """Seconds by size, bucketed; ``samples`` per bucket. Mutated only by ``observe``/``load``."""

    __slots__ = ("prior", "alpha", "_v", "_n")

    def __init__(self, prior: float, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.prior = prior
        self.alpha = alpha
        self._v: dict[int, float] = {}
        self._n: dict[int, int] = {}

    @property
    def measured(self) -> bool:
        return bool(self._v)

    def observe(self, x: float, seconds: float) -> None:
        """Fold one measurement of size ``x`` in. Mutates: its bucket."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        b = bucket(x)
        self._v[b] = ewma(self._v.get(b), seconds, self.alpha)
        self._n[b] = self._n.get(b, 0) + 1

    def value(self, x: float) -> float:
        """The learned seconds at size ``x`` (the prior while nothing is measured)."""
        if not self._v:
            return self.prior
        b = bucket(x)
        if b in self._v:
            return self._v[b]
        keys = sorted(self._v)
        lo = [k for k in keys if k < b]
        hi = [k for k in keys if k > b]
        if not lo:
            return self._v[hi[0]]
        if not hi:
            return self._v[lo[-1]]
        a, c = lo[-1], hi[0]
        f = (math.log2(b) - math.log2(a)) / (math.log2(c) - math.log2(a))
        return self._v[a] + f * (self._v[c] - self._v[a])

    def points(self) -> list[tuple[int, float, int]]:
        """``(bucket, seconds, samples)`` per measured bucket, ascending."""
        return [(k, self._v[k], self._n[k]) for k in sorted(self._v)]

    def load(self, points: Iterable[tuple[int, float, int]] | Iterable[tuple[int, float]]) -> None:
        """Replace the buckets by another curve's (a heartbeat's): the engine's EWMA is the learned value.
        Mutates: every bucket."""
        self._v, self._n = {}, {}
        for p in points:
            at, s = int(p[0]), float(p[1])
            if at > 0 and s > 0 and math.isfinite(s):
                self._v[bucket(at)] = s
                self._n[bucket(at)] = int(p[2]) if len(p) > 2 else 1


def prefill_seconds(per_token: CostCurve | None, scalar: float, tokens: float, context_end: float) -> float:
    """Seconds to prefill ``tokens`` tokens ending at position ``context_end``: the curve's per-token cost at
    their mean position when it is measured, else ``tokens * scalar`` (the same arithmetic as a scalar profile)."""
    if per_token is None or not per_token.measured or tokens <= 0:
        return tokens * scalar
    return tokens * per_token.value(max(1.0, context_end - tokens / 2))


def points_from_proto(items: Iterable[pb.LearnedCost]) -> list[tuple[int, float, int]]:
    return [(int(c.at), float(c.seconds), int(c.samples)) for c in items]
