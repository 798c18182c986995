"""Holding a slot open for returns expected soon (Talaria §1 and §3.4; leases of §3.3 with predicted return
gaps, and the router's lease arithmetic: a hold must not lose more than it saves).

Design note. A slot closes early when its model has nothing in flight and another model has work
(``scheduler.py``). In an agent workload that is exactly the moment a session sits in its tool gap: closing
then sends its return, a fraction of a second later, to the model's *next* slot -- a whole round away, the
round-based scheduler's defect that Talaria exists to fix (§1: "a correctly placed return waits a whole
round"; §3.4: returning sessions are admitted mid-slot by SP, which needs the slot to be open). The router
already predicts each return: when it installs a lease it sends the engine holding the session's KV a
retention hint, the log-normal return gap ``(mu, sigma)`` learned per (model, tool) and the lease window
(``kv/retention.py``, ``services/router/return_gap.py``). This module turns those predictions into one
decision: hold the slot idle for ``h`` seconds, or close it now.

With ``e_i`` the time since return ``i``'s call ended, ``W`` the wait a return avoids by being served in
this slot (until the model's next slot: the rest of the round, ``SpGain.wait_saved_s``), ``n`` the calls of
other models waiting for their slots (``SpGain.waiting_others``), ``a`` the other models' sessions expected
back within ``W`` (their own leases' hints: the work their slots would take on while this one idles) and
``c_i`` the return's own service time (its predicted prefill and decode). ``a`` also counts the calls of
this model queued and not admissible mid-slot (they wait for its next slot, which the hold pushes back):

    p_i(h)   = P(gap_i <= e_i + h | gap_i > e_i)        (uniform over the window's rest for a fixed-tau lease)
    gain(h)  = sum_i p_i(h) * max(0, W - n * c_i)       (the SP verdict of ``admission.SpGain`` per return)
    harm(h)  = h * (n + a)                              (every call waiting or arriving elsewhere is delayed)

The hold is the ``h`` among a few candidates (each return's conditional median, 80th and 95th percentile,
clipped to the slot's budget left minus the return's service, and to its lease window) that maximises
``gain - harm``; no hold when that is <= 0, so a hold is only taken where it is expected to pay. ``harm``
charges the full ``h`` although the hold ends at the first return (an upper bound: conservative). It is
never a pin, and never taken in a round without slack: when the open round is already predicted past
its bound (Eq. 5's shortfall) or P had to defer prefill, the instance is saturated, and on a saturated,
work-conserving instance an idle second delays every piece of queued work (measured in the simulator's
paper replay: holding there traded the switches it saved for as much idle time, SCT p50 +-10 % by seed).
The hold is re-decided at every scheduler call (the conditional probabilities decay as the gap
grows, so a hold whose value is spent ends by itself), it never runs past the slot's budget (Eq. 5's round
bound stands), and a slot with nothing waiting elsewhere does not close at all, so it needs no hold.

Pure (no I/O, no clock): the executor reports the returns in ``ModelView.returns``; times are the caller's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from talaria.return_prob import lognormal_cdf, p_back_by

from .types import ReturnView

_N = NormalDist()
QUANTILES = (0.5, 0.8, 0.95)  # candidate holds: these conditional quantiles of each return's gap
MIN_HOLD_S = 1e-3  # shorter holds are not worth a scheduler round trip


def p_within(r: ReturnView, h: float) -> float:
    """P(the return comes within the next ``h`` seconds | it has not come yet), inside its lease window."""
    rest = r.window_s - r.elapsed_s
    if rest <= 0 or h <= 0:
        return 0.0
    h = min(h, rest)
    if r.gap_sigma <= 0:  # a fixed-tau lease: nothing known but the window -> uniform over its rest
        return h / rest
    return p_back_by(r.gap_mu, r.gap_sigma, r.elapsed_s, r.elapsed_s + h)


def quantile_in(r: ReturnView, q: float) -> float:
    """Seconds from now until the return has come with conditional probability ``q`` (capped at its window)."""
    rest = max(0.0, r.window_s - r.elapsed_s)
    if r.gap_sigma <= 0:
        return q * rest
    f0 = lognormal_cdf(r.gap_mu, r.gap_sigma, r.elapsed_s)
    target = min(1.0 - 1e-9, f0 + q * (1.0 - f0))
    t = math.exp(r.gap_mu + r.gap_sigma * _N.inv_cdf(target))
    return min(rest, max(0.0, t - r.elapsed_s))


@dataclass(frozen=True, slots=True)
class HoldPlan:
    hold_s: float
    gain_s: float  # expected round wait saved by the returns served in this slot, net of their delay to others
    harm_s: float  # the hold's delay to other models' waiting calls
    expected: float  # expected number of returns within the hold


def plan_hold(returns: tuple[ReturnView, ...], *, wait_saved_s: float, waiting_others: int, left_s: float,
              service_s: tuple[float, ...], arriving_others: float = 0.0) -> HoldPlan | None:
    """The hold that pays most (see the module note), or None. ``service_s[i]`` is return i's predicted
    service time; ``left_s`` the slot's budget left; ``arriving_others`` the expected number of other
    models' sessions returning while their slots would run (the hold delays them as well). Pure."""
    if not returns or left_s <= MIN_HOLD_S:
        return None
    values = [max(0.0, wait_saved_s - waiting_others * c) for c in service_s]
    if not any(v > 0 for v in values):
        return None
    cands = {min(left_s, quantile_in(r, q)) for r in returns for q in QUANTILES}
    best: HoldPlan | None = None
    for h in sorted(c for c in cands if c >= MIN_HOLD_S):
        ps = [p_within(r, h) if h + c <= left_s else 0.0 for r, c in zip(returns, service_s)]
        gain = sum(p * v for p, v in zip(ps, values))
        harm = h * (waiting_others + arriving_others)
        if gain - harm > 0 and (best is None or gain - harm > best.gain_s - best.harm_s):
            best = HoldPlan(h, gain, harm, sum(ps))
    return best
