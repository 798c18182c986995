"""When does a session come back: probabilities of a log-normal return gap, and a learner for one.

Design note (Talaria §3.3 soft reservations; JointServe §3.2 reuse likelihood). An agent session leaves for a
tool call and comes back after a gap whose length is well described by a log-normal (most gaps short, a long
tail). Three places ask the same questions of that distribution: the engine's retention (which session's KV to
keep on the device: ``services/engine/kv/retention.py``), the cold engine's slot hold (``slots/hold.py``) and
the host KV store's eviction (``services/kvstore/registry.ValuePerByte``: the reuse likelihood of a page that
has been idle for a while). They share these functions so that "how likely is a return" is written once.

``LogGapFit`` learns the distribution from observed gaps (an EWMA of ``ln gap`` and of its square), so the
horizon after which idle state is presumed dead is measured, not configured. Pure: no clock, no I/O;
``LogGapFit.observe`` mutates only the fit.
"""

from __future__ import annotations

import math

from talaria.ewma import Ewma

_SQRT2 = math.sqrt(2.0)


def normal_cdf(x: float) -> float:
    """Standard normal CDF."""
    return 0.5 * math.erfc(-x / _SQRT2)


def normal_quantile(q: float) -> float:
    """Standard normal quantile (Acklam's rational approximation, |error| < 1.2e-9)."""
    if not 0.0 < q < 1.0:
        raise ValueError("quantile must be in (0, 1)")
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01, -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    lo = 0.02425
    if q < lo:
        s = math.sqrt(-2 * math.log(q))
        return (((((c[0] * s + c[1]) * s + c[2]) * s + c[3]) * s + c[4]) * s + c[5]) / ((((d[0] * s + d[1]) * s + d[2]) * s + d[3]) * s + 1)
    if q > 1 - lo:
        return -normal_quantile(1 - q)
    r = q - 0.5
    t = r * r
    return (((((a[0] * t + a[1]) * t + a[2]) * t + a[3]) * t + a[4]) * t + a[5]) * r / (((((b[0] * t + b[1]) * t + b[2]) * t + b[3]) * t + b[4]) * t + 1)


def lognormal_cdf(mu: float, sigma: float, t: float) -> float:
    """P(gap <= t) for a log-normal gap (``sigma`` > 0)."""
    if t <= 0:
        return 0.0
    return 0.5 * math.erfc(-((math.log(t) - mu) / sigma) / _SQRT2)


def p_back_by(mu: float, sigma: float, elapsed: float, t: float) -> float:
    """P(gap <= t | gap > elapsed) for a log-normal gap: the chance a session away for ``elapsed`` seconds is
    back by ``t`` (0 once the distribution's tail is spent)."""
    f0 = lognormal_cdf(mu, sigma, elapsed)
    tail = 1.0 - f0
    if tail <= 1e-12:
        return 0.0
    return max(0.0, (lognormal_cdf(mu, sigma, t) - f0) / tail)


class LogGapFit:
    """A log-normal fitted to observed gaps: ``mu`` / ``sigma`` of ``ln gap`` by EWMA (``alpha``), usable once
    ``min_samples`` gaps were seen; ``sigma`` is at least ``sigma_floor`` so a run of equal gaps does not make
    the survival a step function."""

    __slots__ = ("_m1", "_m2", "min_samples", "sigma_floor")

    def __init__(self, alpha: float = 0.05, min_samples: int = 16, sigma_floor: float = 0.25) -> None:
        self._m1 = Ewma(0.0, alpha)
        self._m2 = Ewma(0.0, alpha)
        self.min_samples = min_samples
        self.sigma_floor = sigma_floor

    def observe(self, gap_s: float) -> None:
        """Fold one observed gap (seconds; floored at 1 ms) in. Mutates the fit."""
        x = math.log(max(1e-3, gap_s))
        self._m1.add(x)
        self._m2.add(x * x)

    @property
    def samples(self) -> int:
        return self._m1.samples

    @property
    def ready(self) -> bool:
        return self._m1.samples >= self.min_samples

    @property
    def mu(self) -> float:
        return self._m1.value

    @property
    def sigma(self) -> float:
        var = max(0.0, self._m2.value - self._m1.value ** 2)
        return max(self.sigma_floor, math.sqrt(var))

    def survival(self, t: float) -> float:
        """P(gap > t) under the fit (call only when ``ready``)."""
        return 1.0 - lognormal_cdf(self.mu, self.sigma, t)

    def quantile(self, q: float) -> float:
        """The gap below which a fraction ``q`` of gaps fall (0 < q < 1), seconds."""
        return math.exp(self.mu + normal_quantile(q) * self.sigma)
