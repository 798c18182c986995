"""Holding an idle slot open for returns expected soon (``services/engine/slots/hold.py``): the probability
arithmetic, the decision and its bounds in the scheduler, and the closed-loop effect on a two-model
workload under a virtual clock (fake executor, true costs the scheduler learns)."""

from __future__ import annotations

import math
import statistics

import pytest

from services.engine.slots import CallView, CostModel, CostProfile, InstanceView, ModelView, Phase, SlotPolicy, SlotScheduler
from services.engine.slots.hold import p_within, plan_hold, quantile_in
from services.engine.slots.types import ReturnView
from tests.fakes.slot_executor import CallSpec, FakeExecutor, SessionSpec, simulate

TRUTH = CostProfile(prefill_per_token=1e-3, decode_step=0.01, restore_per_token=1e-5,
                    switch_by_path={"full_staged": 0.05, "partial": 0.1, "host_only": 0.3})


def _ret(sid="s", elapsed=0.1, median=0.4, sigma=0.3, window=2.0, tokens=10):
    return ReturnView(sid, elapsed, math.log(median), sigma, window, tokens, 60, 200)


def test_return_probabilities_are_conditional_and_bounded_by_the_window():
    r = _ret(elapsed=0.0)
    assert p_within(r, 0.4) == pytest.approx(0.5)  # the median, from the call's end
    late = _ret(elapsed=0.4)
    assert p_within(late, 0.4) < p_within(r, 0.8) and 0 < p_within(late, 0.4) < 1  # conditional on not yet
    assert p_within(_ret(elapsed=2.5), 1.0) == 0.0  # the window has ended
    assert p_within(r, 100.0) == pytest.approx(p_within(r, 2.0))  # capped at the window
    fixed = ReturnView("f", 0.5, 0.0, 0.0, 1.5, 1)  # a fixed-tau lease: uniform over the window's rest
    assert p_within(fixed, 0.25) == pytest.approx(0.25) and quantile_in(fixed, 0.5) == pytest.approx(0.5)
    for q in (0.5, 0.8, 0.95):
        assert p_within(late, quantile_in(late, q)) == pytest.approx(q)


def test_hold_only_when_the_saved_round_wait_beats_the_delay_to_others():
    rs = (_ret(),)
    plan = plan_hold(rs, wait_saved_s=3.0, waiting_others=2, left_s=5.0, service_s=(0.1,))
    assert plan is not None and 0 < plan.hold_s <= 2.0 - 0.1
    assert plan.gain_s - plan.harm_s > 0 and plan.harm_s == pytest.approx(2 * plan.hold_s)
    # the same return when 40 calls wait elsewhere: every hold costs more than it can save
    assert plan_hold(rs, wait_saved_s=3.0, waiting_others=40, left_s=5.0, service_s=(0.1,)) is None
    # a return that would itself cost others more than the round wait it saves (SP would defer it anyway)
    assert plan_hold(rs, wait_saved_s=3.0, waiting_others=2, left_s=5.0, service_s=(2.0,)) is None
    # no budget left in the slot for the return after the hold
    assert plan_hold(rs, wait_saved_s=3.0, waiting_others=2, left_s=0.2, service_s=(0.1,)) is None
    # a return expected long after the window: its probability within any hold is small
    assert plan_hold((_ret(median=60.0),), wait_saved_s=3.0, waiting_others=2, left_s=5.0, service_s=(0.1,)) is None


def _call(rid, model, arrival, cont=False, state="missing", prefix=0, prompt=200, max_tokens=10):
    return CallView(rid, model, arrival, prompt, max_tokens, rid, prefix, state, cont)


B0 = (_call("b0", "b", 0.0, prompt=1500),)  # b's slot: a 0.3 s switch in, 1.5 s of prefill, 0.3 s back
UNSTAGED = {"a": 0.0, "b": 0.0}


def _view(a: ModelView) -> InstanceView:
    return InstanceView("a", (a, ModelView("b", queued=B0)), None, UNSTAGED)


def _slot_of_a_then_idle(policy: SlotPolicy, returns):
    """a's slot opens at 0 with one call; at 0.3 it has finished, b waits; a's session is expected back."""
    s = SlotScheduler(policy, CostModel(TRUTH))
    assert s.decide(_view(ModelView("a", queued=(_call("a0", "a", 0.0),))), 0.0).phase is Phase.P
    return s, s.decide(_view(ModelView("a", returns=returns)), 0.3)


def test_scheduler_holds_the_slot_for_a_return_and_admits_it_mid_slot():
    pol = SlotPolicy(ttft_s=4.0, tpot_s=0.1)
    s, d = _slot_of_a_then_idle(pol, (_ret("a0", elapsed=0.05, median=0.3),))
    assert d.phase is Phase.HOLD and d.switch_to is None and not d.run_step and 0 < d.hold_s <= 2.0
    assert s.decide(_view(ModelView("a", returns=(_ret("a0", elapsed=0.1, median=0.3),))), 0.35).phase is Phase.HOLD
    back = _call("a0", "a", 0.4, cont=True, state="device", prefix=190, prompt=260)
    d2 = s.decide(_view(ModelView("a", queued=(back,))), 0.4)
    assert d2.phase is Phase.SP and d2.admit == ("a0",) and d2.switch_to is None
    d3 = s.decide(_view(ModelView("a")), 0.6)
    assert d3.switch_to == "b"  # no return expected any more: the slot closes
    s.decide(InstanceView("b", (ModelView("a"), ModelView("b"))), 9.0)
    (r,) = s.take_summaries()
    assert r.holds == 1 and r.phase_s["hold"] == pytest.approx(0.1) and r.hold_gain_s > r.hold_harm_s > 0
    assert r.flags["return_hold"] and r.sp_admitted == 1


@pytest.mark.parametrize("policy, returns", [
    (SlotPolicy(ttft_s=4.0, tpot_s=0.1, return_hold=False), (_ret("a0", elapsed=0.05, median=0.3),)),  # ablation
    (SlotPolicy(ttft_s=4.0, tpot_s=0.1, sp=False), (_ret("a0", elapsed=0.05, median=0.3),)),  # no SP: a return could not join
    (SlotPolicy(ttft_s=4.0, tpot_s=0.1), ()),  # nobody expected
    (SlotPolicy(ttft_s=4.0, tpot_s=0.1), (_ret("a0", elapsed=0.05, median=30.0, window=60.0),)),  # expected far later
    (SlotPolicy(ttft_s=0.3, tpot_s=0.1), (_ret("a0", elapsed=0.05, median=0.3),)),  # the slot's budget is spent
])
def test_no_hold_where_it_cannot_pay(policy, returns):
    _, d = _slot_of_a_then_idle(policy, returns)
    assert d.phase is not Phase.HOLD and d.switch_to == "b"


def _agents(gap_s: float, n: int = 3, calls: int = 6):
    """Sessions on two models alternating tool calls: each call adds ~120 tokens to a growing prompt."""
    out = []
    for m in ("a", "b"):
        for i in range(n):
            specs = tuple(CallSpec(300 + 130 * k, 10, gap_s) for k in range(calls))
            out.append(SessionSpec(f"{m}{i}", m, 0.01 * i, specs))
    return out


PAPERISH = CostProfile(prefill_per_token=1e-3, decode_step=0.01, restore_per_token=1e-5,
                       switch_by_path={"full_staged": 0.5, "partial": 1.0, "host_only": 2.0})


def _run(gap_s: float, hold: bool, truth: CostProfile = TRUTH, ttft_s: float = 4.0):
    sched = SlotScheduler(SlotPolicy(ttft_s=ttft_s, tpot_s=0.1, return_hold=hold), CostModel(truth))
    ex = FakeExecutor(["a", "b"], truth, d2d_staging=False)
    hint = lambda spec: (math.log(spec.gap_after_s), 0.2, 5 * spec.gap_after_s)  # noqa: E731 - the router's prediction
    return simulate(_agents(gap_s), sched, ex, hint=hint)


def _p50(xs) -> float:
    return statistics.median(xs)


@pytest.mark.parametrize("gap_s, truth, ttft_s, sct_gain", [
    (0.2, TRUTH, 4.0, 1.05),  # switches of 0.3 s, a round of ~1.6 s: modest
    (0.2, PAPERISH, 10.0, 2.0),  # switches of 2 s (host-only), the paper's regime: returns no longer wait a round
    (1.0, PAPERISH, 10.0, 1.2),
])
def test_closed_loop_short_tool_gaps_returns_stop_waiting_a_round(gap_s, truth, ttft_s, sct_gain):
    """Without the hold every return misses its slot and waits for the other model's; with it, returns are
    served mid-slot. Sessions of both models finish sooner, the slowest one too."""
    on, off = _run(gap_s, True, truth, ttft_s), _run(gap_s, False, truth, ttft_s)
    assert sum(r.holds for r in on.summaries) > 0 and sum(r.holds for r in off.summaries) == 0
    assert _p50(on.ttft(returning=True)) < 0.5 * _p50(off.ttft(returning=True))
    assert _p50(on.sct.values()) * sct_gain < _p50(off.sct.values())
    assert max(on.sct.values()) < max(off.sct.values())  # no session pays for the others' holds


@pytest.mark.parametrize("gap_s, truth, ttft_s", [(0.5, TRUTH, 4.0), (2.0, TRUTH, 4.0), (4.0, PAPERISH, 10.0), (8.0, PAPERISH, 10.0)])
def test_closed_loop_where_holding_cannot_pay_the_schedule_is_unchanged(gap_s, truth, ttft_s):
    """Gaps as long as the other model's slot (or longer), predicted as such: no hold is taken, so the
    schedule is exactly the one without the mechanism (it never loses)."""
    on, off = _run(gap_s, True, truth, ttft_s), _run(gap_s, False, truth, ttft_s)
    assert sum(r.holds for r in on.summaries) == 0
    assert on.sct == off.sct and on.ttft() == off.ttft()
