"""Tool-aware leases: predicting when a session returns, sizing its lease, and deciding whether a lease pays.

Design note. Talaria §3.3 installs a lease of fixed length tau after
every call and names an adaptive tau as future work; Continuum sets a KV time-to-live per tool call from
the reload cost and the queueing it causes; SGLang reverted a hard TTL pin because pinned memory wedged
the server, and keeps retention *soft and decaying*. Here:

* **Return gap** = response end -> the session's next call (any model). It is learned online per
  ``(model, tool)`` -- the model that answered and the tool its answer called ("" when it called none: a
  final answer, a hand-off to another model) -- as a log-normal: an EWMA of the mean and of the variance of
  ``ln gap`` (``talaria.ewma``). Tool run times are heavy-tailed and multiplicative (an ``ls`` in 50 ms, a
  test run in minutes), so log space is where a mean and a spread mean something. Until a key has
  ``min_samples`` returns its model-wide estimate stands in, and before that the cold-start prior (median
  ``prior_median_s`` = the paper's tau of 1 s, ``prior_sigma``). A caller's own expectation
  (``hint_s``: e.g. an "expected tool time" request hint, another branch) overrides the median with
  ``hint_sigma`` of spread. Gaps over ``max_gap_s`` are not returns (the session paused) and teach nothing.
* **Lease window** = the ``quantile`` (default 0.9) of the predicted gap, clamped to ``[floor_s, cap_s]``,
  or, with the lease arithmetic on, the shorter window up to it that nets the most (``best_window``: the
  return probability it buys times the saving, less its expected hold times the holding price). For a
  well-predicted tool the two agree; an uncertain estimate (the model-wide one pools ``ls`` with ``pytest``:
  sigma ~3 in log space) gets a short window over its fast returns instead of seconds for its tail.
* **Decaying value**: a live lease is worth the probability that its return still comes inside the window
  given that it has not come yet, ``P(gap <= w | gap > elapsed)`` -- 1-ish right after the call, falling
  smoothly to 0 at the window's end (``lease_weight``). The engine's retention and slot hold weigh the
  return by it (the retention hint carries ``mu, sigma``), so a session whose return grows unlikely yields
  its memory first. Placement charges a live lease against its instance by that weight only with
  ``lease_decay``; by default it charges one full admission unit until the window ends, as a fixed tau
  does. Measured (``talaria sim leases --decay``, ``services/router/README.md``): with the decaying charge,
  other calls fill the instance while the return is still likely: mini-swe-agent's SCT p50 with the full
  charge was 0.971x [0.935-1.008] of the decaying one's (paired, 36 seeds; per-tool workload: a tie). The
  window itself is what adapts.
* **Lease arithmetic** (``judge_lease``): installing a lease is worth ``P(return within window) x saved_s``
  (what a hit saves: recomputing or restoring the committed prefix elsewhere, from the router's measured
  per-token costs -- or, once measured, more: Continuum prices a KV TTL by the reload *and the queueing*
  a returning call pays without it. On a cold instance a return that lost its device residency (its model
  switched out meanwhile) waits for the model's next slot: measured in the simulator, 0.5 s to first
  token resident vs 17-24 s not, while the host restore of a 20K-token prefix is ~30 ms. ``ResidencyBook``
  learns that from the returns' hooks: the residency share a lease buys x what losing it costs. Both prices
  are of a return that *lost* its residency, so once measured the saving is ``share x max(Eq. 1 difference,
  measured loss)``: a lease is worth only the returns whose residency it changes -- on the real stack 89-90 %
  of returns without a lease kept their prefix anyway, and pricing each lease as a certain loss held 3x the
  KV of a fixed 0.5 s tau for no SCT difference. The Eq. 1 price is of the place such a return would go: the
  cheaper of this instance with the prefix off its device (restored or recomputed here) and the best other
  instance; priced by the other instance alone, its slot wait for a model between slots there priced leases
  at seconds that no return paid, and one stack repetition in three held 4x fixed 0.5 s's KV. Since then
  adaptive holds 0.03x the best fixed tau's token-seconds on the stack for the same SCT, and declines nearly
  every lease on the mini-swe-agent replay, whose gaps are longer than any lease is worth there) and costs ``E[time held] x harm_per_s`` (the admission charge it puts on other calls
  arriving at its instance meanwhile: their arrival rate x one mean call of queueing, from the measured
  profiles; at any load when another instance can take them, since placement charges it at any load --
  scaled by the instance's busy share only on a lone instance). A lease that costs more than it saves is
  not installed. With the charge priced at light load too (2026-12-06), adaptive holds 0.27-0.38x the KV of
  the best fixed tau at the testbed's load and matches it at a third of the load, where it used to hold
  1.8-2.3x and lose (``services/router/README.md`` (9)). At the return itself the policy
  honours a lease only while its instance is the cheapest by Eq. 1 (``policy._outweighed``): Eq. 1 then
  prices the actual alternative (a restore there, its slot wait, both queues), so the measured saving,
  an expectation over returns placed anywhere, is not added again as a margin (it was until 2026-12-06:
  returns stayed on a busier instance by seconds and the batches were balanced worse; measured in
  ``services/router/README.md``).

Pure: no clock is read (every time is an argument), no I/O. ``GapPredictor``, ``ReturnTracker`` and
``ResidencyBook`` mutate only themselves.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from talaria.ewma import ewma
from talaria.return_prob import normal_cdf, normal_quantile

@dataclass(frozen=True, slots=True)
class GapParams:
    """Knobs of the return-gap predictor (``talaria.config.PlacementConfig`` fields ``gap_*``)."""

    prior_median_s: float = 1.0  # cold start: the paper's fixed tau
    prior_sigma: float = 1.0  # cold start spread of ln(gap): p90 = 3.6 x the median
    alpha: float = 0.2  # EWMA weight of the newest return
    min_samples: int = 3  # returns a (model, tool) key needs before its own estimate is used
    quantile: float = 0.9  # lease window = this quantile of the predicted gap
    floor_s: float = 0.05
    cap_s: float = 10.0  # never reserve longer than this (the replay caps tool gaps at 10 s too)
    max_gap_s: float = 600.0  # a longer gap is a pause, not a return: not learned
    hint_sigma: float = 0.5  # spread around a caller-given expected tool time
    min_sigma: float = 0.05  # a key that always returns in exactly the same time still has some spread


@dataclass(frozen=True, slots=True)
class GapEstimate:
    """Predicted return gap: ln(gap) ~ N(mu, sigma^2)."""

    mu: float
    sigma: float
    samples: int = 0
    source: str = "prior"  # "tool" | "model" | "prior" | "hint"

    @property
    def median_s(self) -> float:
        return math.exp(self.mu)

    def quantile(self, q: float) -> float:
        return math.exp(self.mu + normal_quantile(q) * self.sigma)

    def cdf(self, t: float) -> float:
        """P(gap <= t)."""
        if t <= 0:
            return 0.0
        return normal_cdf((math.log(t) - self.mu) / self.sigma)

    def p_within(self, start: float, end: float) -> float:
        """P(gap <= end | gap > start): the return still comes by ``end`` given it has not come by ``start``."""
        if end <= start:
            return 0.0
        tail = 1.0 - self.cdf(start)
        if tail <= 1e-12:
            return 0.0
        return max(0.0, min(1.0, (self.cdf(end) - self.cdf(start)) / tail))

    def expected_hold(self, window: float) -> float:
        """E[min(gap, window)]: how long a lease of ``window`` is held on average (consumed or expired)."""
        if window <= 0:
            return 0.0
        m, s = self.mu, self.sigma
        lw = math.log(window)
        partial = math.exp(m + s * s / 2) * normal_cdf((lw - m - s * s) / s)  # E[gap; gap < window]
        return partial + window * (1.0 - self.cdf(window))


class _LogStats:
    __slots__ = ("mean", "var", "n")

    def __init__(self) -> None:
        self.mean: float | None = None
        self.var = 0.0
        self.n = 0

    def add(self, x: float, alpha: float) -> None:
        if self.mean is None:
            self.mean = x
        else:
            d = x - self.mean
            self.mean = ewma(self.mean, x, alpha)
            self.var = ewma(self.var, d * d, alpha) if self.n > 1 else d * d
        self.n += 1


class GapPredictor:
    """Per-(model, tool) log-normal return gaps learned online. Mutates only itself (``observe``)."""

    def __init__(self, params: GapParams | None = None) -> None:
        self.p = params or GapParams()
        self._by_key: dict[tuple[str, str], _LogStats] = {}
        self._by_model: dict[str, _LogStats] = {}

    def observe(self, model: str, tool: str, gap_s: float) -> bool:
        """Learn one observed return; False (nothing learned) for a gap <= 0 or over ``max_gap_s``."""
        if not (0.0 < gap_s <= self.p.max_gap_s):
            return False
        x = math.log(max(gap_s, 1e-4))
        self._by_key.setdefault((model, tool), _LogStats()).add(x, self.p.alpha)
        self._by_model.setdefault(model, _LogStats()).add(x, self.p.alpha)
        return True

    def predict(self, model: str, tool: str, hint_s: float | None = None) -> GapEstimate:
        """The predicted gap after a call of ``model`` that called ``tool`` ("" = none). ``hint_s``: the
        caller's expected tool time (a request hint), which wins over what was learned."""
        p = self.p
        if hint_s is not None and hint_s > 0:
            return GapEstimate(math.log(hint_s), p.hint_sigma, 0, "hint")
        for source, st in (("tool", self._by_key.get((model, tool))), ("model", self._by_model.get(model))):
            if st is not None and st.mean is not None and st.n >= p.min_samples:
                return GapEstimate(st.mean, max(p.min_sigma, math.sqrt(st.var)), st.n, source)
        return GapEstimate(math.log(p.prior_median_s), p.prior_sigma, 0, "prior")

    def window(self, est: GapEstimate) -> float:
        """Lease length for ``est``: its ``quantile``, clamped to [floor_s, cap_s]."""
        return max(self.p.floor_s, min(self.p.cap_s, est.quantile(self.p.quantile)))

    def keys(self) -> dict[str, dict]:
        """What was learned (for /router/metrics): ``model|tool`` -> median, sigma, samples."""
        return {
            f"{m}|{t}": {"median_s": math.exp(s.mean), "sigma": math.sqrt(s.var), "n": s.n}
            for (m, t), s in self._by_key.items() if s.mean is not None
        }


@dataclass(frozen=True, slots=True)
class PendingReturn:
    model: str
    tool: str
    done_unix: float


class ReturnTracker:
    """The last finished call of each session, so its next call becomes a gap observation. Bounded (LRU)."""

    def __init__(self, max_sessions: int = 65536) -> None:
        self.max_sessions = max_sessions
        self._s: OrderedDict[str, PendingReturn] = OrderedDict()

    def ended(self, session_id: str, model: str, tool: str, done_unix: float) -> None:
        """Record a finished call (mutates)."""
        self._s.pop(session_id, None)
        self._s[session_id] = PendingReturn(model, tool, done_unix)
        while len(self._s) > self.max_sessions:
            self._s.popitem(last=False)

    def returned(self, session_id: str, now: float) -> tuple[PendingReturn, float] | None:
        """The session called again: its pending return and the gap, removed (mutates); None if unknown."""
        pr = self._s.pop(session_id, None)
        if pr is None:
            return None
        return pr, max(0.0, now - pr.done_unix)

    def peek(self, session_id: str) -> PendingReturn | None:
        return self._s.get(session_id)


def lease_weight(mu: float, sigma: float, t_done: float, t_exp: float, now: float) -> float:
    """A live lease's value in placement, in [0, 1]. ``sigma <= 0`` (a fixed-tau lease): 1 until ``t_exp``
    (the cliff). Else ``P(gap <= t_exp - t_done | gap > now - t_done)``: decays as the return fails to come."""
    if now >= t_exp:
        return 0.0
    if sigma <= 0:
        return 1.0
    return GapEstimate(mu, sigma).p_within(max(0.0, now - t_done), t_exp - t_done)


class ResidencyBook:
    """What a lease saves a returning call, *measured* (Continuum: a KV time-to-live is worth the reload and
    the queueing the returning call pays without it). From the completion hooks of returning calls, pooled
    over models (it is a property of the instances' schedules, and pooling keeps it learned on sparse
    traffic; each mean is the running mean of its first 1/alpha samples, an EWMA after): the time to first token of returns whose prefix was still on the device (``resident``:
    cached tokens beyond those restored from host) and of those that were not (restored from host or
    recomputed; on a cold instance also the wait for the model's next slot), and the EWMA share of resident
    returns among those placed on their lease and those not. ``saving`` = (share resident with a lease -
    share without) x (TTFT not resident - TTFT resident): the residency a lease buys, priced by what losing
    it cost the calls that lost it. Both sides are observed whatever the lease policy decides, so it does
    not feed on its own decisions the way a hit-vs-miss TTFT difference does (under the lease arithmetic
    the few hits are a selected sample: measured here, hits looked *slower* than misses). Mutates only itself."""

    def __init__(self, alpha: float = 0.05, min_samples: int = 5) -> None:
        self.alpha = alpha
        self.min_samples = min_samples
        self._ttft: dict[bool, tuple[float, int]] = {}  # resident -> (EWMA ttft, samples)
        self._share: dict[bool, tuple[float, int]] = {}  # placed on its lease -> (EWMA resident share, samples)

    def _add(self, book: dict, key: bool, x: float) -> None:
        # the running mean until 1/alpha samples, an EWMA after: a plain EWMA started at its first sample
        # weighs that sample 0.81 after five (alpha 0.05), and the rare side (lost returns) is read early
        mean, n = book.get(key, (x, 0))
        book[key] = (ewma(mean, x, max(self.alpha, 1.0 / (n + 1))) if n else x, n + 1)

    def observe(self, on_lease: bool, resident: bool, ttft_s: float) -> None:
        """One returning call: placed on its lease or not, its prefix found on device or not, its TTFT (mutates)."""
        if ttft_s <= 0 or not math.isfinite(ttft_s):
            return
        self._add(self._ttft, resident, ttft_s)
        self._add(self._share, on_lease, 1.0 if resident else 0.0)

    def _loss_s(self) -> float | None:
        """TTFT lost - TTFT kept (>= 0); None until both sides have ``min_samples`` returns."""
        kept, lost = self._ttft.get(True), self._ttft.get(False)
        if kept is None or lost is None or min(kept[1], lost[1]) < self.min_samples:
            return None
        return max(0.0, lost[0] - kept[0])

    def lift(self) -> tuple[float, float] | None:
        """``(share, loss_s)``: how much more often a return keeps its device residency with a lease than without
        (share resident with a lease - share without, in [0, 1]; None until both sides have ``min_samples``
        returns) and the seconds of TTFT a return that lost it paid over one that kept it (>= 0; 0.0 until
        both of those sides have ``min_samples``: lost returns are the rare ones, and the share alone already
        says how often a lease changes the outcome). Pure read."""
        on, off = self._share.get(True), self._share.get(False)
        if on is None or off is None or min(on[1], off[1]) < self.min_samples:
            return None
        loss = self._loss_s()
        return max(0.0, on[0] - off[0]), (0.0 if loss is None else loss)

    def saving(self) -> float | None:
        """Seconds of TTFT a lease saves a return (>= 0): ``share x loss_s`` of ``lift``; None until every side
        has ``min_samples`` returns."""
        lift, loss = self.lift(), self._loss_s()
        return None if lift is None or loss is None else lift[0] * loss

    def snapshot(self) -> dict[str, object]:
        """What was learned (for /router/metrics)."""
        out: dict[str, object] = {f"ttft_{'resident' if k else 'lost'}_s": {"mean": v, "n": n} for k, (v, n) in self._ttft.items()}
        out.update({f"resident_share_{'lease' if k else 'no_lease'}": {"mean": v, "n": n} for k, (v, n) in self._share.items()})
        out["saving_s"] = self.saving()
        return out


@dataclass(frozen=True, slots=True)
class LeaseCosts:
    """Measured inputs of the lease arithmetic (router profiles), seconds."""

    saved_s: float  # what a hit saves: a lost residency where it is cheapest (restored here or Eq. 1's best other instance), x the measured share of returns whose residency a lease changes
    harm_per_s: float  # queueing a live lease imposes on other calls per second it is held


@dataclass(frozen=True, slots=True)
class LeaseJudgement:
    install: bool
    window_s: float
    p_return: float  # P(return within the window)
    value_s: float  # p_return x saved_s
    harm_s: float  # E[hold] x harm_per_s
    expected_hold_s: float
    reason: str  # "worth" | "harm" | "no-window"
    saved_s: float = 0.0  # the costs it was judged by (``LeaseCosts``)
    harm_per_s: float = 0.0


def best_window(est: GapEstimate, costs: LeaseCosts, floor_s: float, max_s: float, points: int = 40) -> float:
    """The window in ``[floor_s, max_s]`` with the most net value ``P(gap <= w) x saved_s - E[min(gap, w)] x
    harm_per_s`` (log-spaced grid of ``points + 1``; ``max_s`` itself when nothing is charged for holding).
    Extending a window pays while the return's hazard at its end, times the saving, beats the holding price:
    after a slow, uncertain tool the tail of the gap distribution holds for seconds per percent of returns,
    so the best window is shorter than its quantile once holding costs anything. Pure."""
    if max_s <= floor_s or costs.harm_per_s <= 0:
        return max_s
    grid = [floor_s * (max_s / floor_s) ** (k / points) for k in range(points + 1)]
    return max(grid, key=lambda w: est.cdf(w) * costs.saved_s - est.expected_hold(w) * costs.harm_per_s)


def judge_lease(est: GapEstimate, window_s: float, costs: LeaseCosts) -> LeaseJudgement:
    """Install a lease of ``window_s`` only if its expected saving beats the delay it imposes on others."""
    if window_s <= 0:
        return LeaseJudgement(False, 0.0, 0.0, 0.0, 0.0, 0.0, "no-window", costs.saved_s, costs.harm_per_s)
    p = est.cdf(window_s)
    hold = est.expected_hold(window_s)
    value = p * costs.saved_s
    harm = hold * costs.harm_per_s
    return LeaseJudgement(value > harm, window_s, p, value, harm, hold, "worth" if value > harm else "harm", costs.saved_s, costs.harm_per_s)


class NextModelBook:
    """Which model a session calls next after a call of ``(model, tool)``, learned from observed returns
    (counts). Feeds intent prefetch: an agent's final answer is followed by the user
    simulator's model, a tool call by the agent again. Mutates only itself."""

    def __init__(self) -> None:
        self._n: dict[tuple[str, str], dict[str, int]] = {}

    def observe(self, model: str, tool: str, next_model: str) -> None:
        d = self._n.setdefault((model, tool), {})
        d[next_model] = d.get(next_model, 0) + 1

    def predict(self, model: str, tool: str) -> tuple[str, float, int] | None:
        """(most likely next model, its share, observations) after ``(model, tool)``; None if never seen."""
        d = self._n.get((model, tool))
        if not d:
            return None
        total = sum(d.values())
        best = max(sorted(d), key=lambda m: d[m])
        return best, d[best] / total, total
