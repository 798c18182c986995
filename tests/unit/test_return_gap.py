"""The return-gap predictor, the decaying lease value and the lease arithmetic (services/router/return_gap.py)."""

from __future__ import annotations

import math
import random

import pytest

from services.router.return_gap import (
    GapEstimate,
    GapParams,
    GapPredictor,
    LeaseCosts,
    ResidencyBook,
    ReturnTracker,
    best_window,
    judge_lease,
    lease_weight,
)
from talaria.return_prob import normal_quantile as _z


def test_normal_quantile_matches_known_values():
    assert _z(0.5) == pytest.approx(0.0, abs=1e-9)
    assert _z(0.9) == pytest.approx(1.2815516, abs=1e-6)
    assert _z(0.01) == pytest.approx(-2.3263479, abs=1e-6)


def test_cold_start_is_the_prior_and_learning_is_per_tool():
    g = GapPredictor(GapParams(prior_median_s=1.0, prior_sigma=1.0, min_samples=3))
    est = g.predict("m", "ls")
    assert est.source == "prior" and est.median_s == pytest.approx(1.0)
    rng = random.Random(0)
    for _ in range(60):
        g.observe("m", "ls", math.exp(rng.gauss(math.log(0.05), 0.2)))
        g.observe("m", "pytest", math.exp(rng.gauss(math.log(6.0), 0.6)))
    ls, pt = g.predict("m", "ls"), g.predict("m", "pytest")
    assert ls.source == "tool" and 0.03 < ls.median_s < 0.08
    assert pt.source == "tool" and 3.5 < pt.median_s < 10.0
    assert g.window(ls) < 0.15 < 4.0 < g.window(pt) <= 10.0
    # an unseen tool of a known model falls back to the model-wide estimate; an unseen model to the prior
    assert g.predict("m", "git").source == "model"
    assert g.predict("other", "ls").source == "prior"


def test_hint_overrides_and_pauses_are_not_learned():
    g = GapPredictor(GapParams(hint_sigma=0.5, max_gap_s=100))
    assert g.predict("m", "x", hint_s=30.0).median_s == pytest.approx(30.0)
    assert g.predict("m", "x", hint_s=30.0).source == "hint"
    assert not g.observe("m", "x", 1000.0)
    assert not g.observe("m", "x", 0.0)
    assert g.observe("m", "x", 2.0)


def test_window_is_capped_and_floored():
    g = GapPredictor(GapParams(cap_s=10.0, floor_s=0.05))
    assert g.window(GapEstimate(math.log(100.0), 1.0)) == 10.0
    assert g.window(GapEstimate(math.log(0.001), 0.1)) == 0.05


def test_lease_weight_decays_instead_of_a_cliff():
    mu, sigma = math.log(1.0), 0.8
    t_exp = 3.0
    ws = [lease_weight(mu, sigma, 0.0, t_exp, t) for t in (0.0, 0.5, 1.0, 2.0, 2.9)]
    assert ws[0] == pytest.approx(GapEstimate(mu, sigma).cdf(t_exp))
    assert all(a > b for a, b in zip(ws, ws[1:]))  # strictly decaying
    assert ws[-1] < 0.2
    assert lease_weight(mu, sigma, 0.0, t_exp, 3.0) == 0.0
    # a fixed-tau lease (sigma 0) is the cliff: full weight until t_exp, then nothing
    assert lease_weight(0.0, 0.0, 0.0, 1.0, 0.99) == 1.0
    assert lease_weight(0.0, 0.0, 0.0, 1.0, 1.0) == 0.0


def test_expected_hold_matches_sampling():
    est = GapEstimate(math.log(0.7), 0.9)
    rng = random.Random(1)
    w = 2.0
    mc = sum(min(math.exp(rng.gauss(est.mu, est.sigma)), w) for _ in range(40000)) / 40000
    assert est.expected_hold(w) == pytest.approx(mc, rel=0.02)


def test_lease_arithmetic_installs_only_what_pays():
    fast = GapEstimate(math.log(0.05), 0.25)
    slow = GapEstimate(math.log(6.0), 1.0)
    busy = LeaseCosts(saved_s=0.5, harm_per_s=0.3)
    j = judge_lease(fast, 0.1, busy)
    assert j.install and j.p_return > 0.9 and j.value_s > j.harm_s
    # a slow, uncertain return on a busy instance: holding for seconds costs more than the hit saves
    j = judge_lease(slow, 10.0, busy)
    assert not j.install and j.reason == "harm" and j.harm_s > j.value_s
    # the same lease on an idle instance (nobody else to delay) is worth it
    assert judge_lease(slow, 10.0, LeaseCosts(saved_s=0.5, harm_per_s=0.0)).install
    assert not judge_lease(slow, 0.0, busy).install


def test_the_best_window_stops_where_holding_stops_paying():
    """A model-wide estimate pools fast and slow tools into one very uncertain gap (median 75 ms, sigma 2.8, as
    learned in the simulator's per-tool workload): its 0.9 quantile is seconds long, but most of its returns
    come in the first few hundred ms and each further second held buys a percent or two. With holding
    priced, the window ends where the hazard times the saving falls below the price, and nets more than the
    quantile window; with holding free the quantile window stands; a lease worth nothing is not installed."""
    mixed = GapEstimate(math.log(0.075), 2.8)
    cap = min(10.0, mixed.quantile(0.9))
    priced = LeaseCosts(saved_s=1.13, harm_per_s=1.66)
    w = best_window(mixed, priced, 0.05, cap)
    net = lambda x: mixed.cdf(x) * priced.saved_s - mixed.expected_hold(x) * priced.harm_per_s  # noqa: E731
    assert 0.1 < w < 0.2 * cap
    assert net(w) > net(cap) + 0.3 and net(w) >= max(net(cap * k / 200) for k in range(1, 201)) - 1e-2
    assert judge_lease(mixed, w, priced).install
    assert best_window(mixed, LeaseCosts(saved_s=1.13, harm_per_s=0.0), 0.05, cap) == cap
    worthless = LeaseCosts(saved_s=0.01, harm_per_s=1.66)
    assert not judge_lease(mixed, best_window(mixed, worthless, 0.05, cap), worthless).install
    # a tool whose returns are well predicted: within its quantile window the hazard keeps paying, the window stands
    slow = GapEstimate(math.log(4.0), 0.8)
    assert best_window(slow, LeaseCosts(saved_s=3.0, harm_per_s=0.3), 0.05, 10.0) == 10.0


def test_return_tracker_turns_the_next_call_into_a_gap():
    t = ReturnTracker(max_sessions=2)
    t.ended("a", "m", "ls", 10.0)
    t.ended("b", "m", "", 11.0)
    t.ended("c", "m", "pytest", 12.0)  # evicts "a"
    assert t.returned("a", 20.0) is None
    pr, gap = t.returned("c", 14.5)
    assert (pr.model, pr.tool, gap) == ("m", "pytest", 2.5)
    assert t.returned("c", 15.0) is None  # consumed


def test_next_model_book_learns_the_handoff():
    from services.router.return_gap import NextModelBook

    b = NextModelBook()
    assert b.predict("agent", "") is None
    for _ in range(4):
        b.observe("agent", "", "user-sim")
        b.observe("agent", "ls", "agent")
    b.observe("agent", "", "agent")
    assert b.predict("agent", "") == ("user-sim", 0.8, 5)
    assert b.predict("agent", "ls") == ("agent", 1.0, 4)


def test_residency_book_prices_the_residency_a_lease_buys():
    """Returns placed on their lease found their prefix on the device, the others did not; a resident return
    waited 0.5 s, one that lost residency 10.5 s: a lease saves (1 - 0) x 10 s. A lease that buys no
    residency (same share with and without) saves nothing, whatever losing residency costs."""
    b = ResidencyBook(alpha=0.3, min_samples=5)
    assert b.saving() is None
    for _ in range(5):
        b.observe(on_lease=True, resident=True, ttft_s=0.5)
    assert b.saving() is None  # nothing yet about returns without a lease
    for _ in range(4):
        b.observe(on_lease=False, resident=False, ttft_s=10.5)
    assert b.saving() is None  # 4 < min_samples
    b.observe(on_lease=False, resident=False, ttft_s=10.5)
    assert b.saving() == pytest.approx(10.0)
    early = ResidencyBook(alpha=0.05, min_samples=5)  # the share is read before any return lost its residency
    for resident in (True, True, True, True, False):
        early.observe(on_lease=False, resident=resident, ttft_s=0.5)
    for _ in range(5):
        early.observe(on_lease=True, resident=True, ttft_s=0.5)
    assert early.lift() == (pytest.approx(0.2), 0.0)  # running mean: 1 of 5 lost, not the first sample's weight
    assert early.saving() is None  # one lost return: its cost is not measured yet
    same = ResidencyBook(alpha=0.3, min_samples=1)
    for on in (True, False):
        same.observe(on, True, 0.5)
        same.observe(on, False, 10.5)
    assert same.saving() == 0.0
    same.observe(True, True, float("nan"))  # no TTFT: not learned
    assert same.snapshot()["resident_share_lease"]["n"] == 2
