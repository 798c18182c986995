"""Per-token deadlines (issue 16, Aegaeon): the tracker's clocks and distribution, the pure token-granularity
scheduler on virtual time, intake validation of per-call hints, and the real cold engine in that mode."""

from __future__ import annotations

import math

import pytest

from services.engine.slots import CallView, CostModel, CostProfile, InstanceView, ModelView, Phase
from services.engine.slots.deadlines import GAP_BUCKETS_S, DeadlinePolicy, DeadlineScheduler, DeadlineTargets, DeadlineTracker
from talaria.switch_path import SwitchPath

PROFILE = CostProfile(prefill_per_token=1e-3, decode_step=0.02, restore_per_token=1e-4,
                      switch_by_path={SwitchPath.FULL_STAGED: 0.1, SwitchPath.PARTIAL: 0.3, SwitchPath.HOST_ONLY: 0.5})


def sched(**kw) -> DeadlineScheduler:
    pol = DeadlinePolicy(**{"ttft_s": 2.0, "tpot_s": 0.1, "margin": 1.0, **kw})
    return DeadlineScheduler(pol, CostModel(PROFILE))


def call(rid, model, arrival, prompt=100, max_tokens=10):
    return CallView(rid, model, arrival, prompt, max_tokens)


# ------------------------------------------------------------------ tracker
def test_deadlines_anchor_on_first_token_and_buffered_tokens_are_slack():
    t = DeadlineTracker(DeadlineTargets(ttft_s=1.0, tpot_s=0.1))
    t.arrive("a", "m", arrival=10.0)
    assert t.next_due("a") == 11.0 and t.slack("a", 10.5) == pytest.approx(0.5)
    t.emit("a", 1, 10.4)  # first token on time; later tokens due 10.5, 10.6, ...
    assert t.next_due("a") == pytest.approx(10.5)
    for k in range(5):
        t.emit("a", 1, 10.41 + 0.01 * k)  # decoding at 10 ms a token: 5 tokens ahead of their deadlines
    assert t.buffered_tokens("a", 10.45) == 5 and t.slack("a", 10.45) == pytest.approx(0.55)
    t.emit("a", 1, 11.5)  # token 7 was due 11.0: late
    st = t.take_window()
    assert (st.first_tokens, st.first_on_time, st.tokens, st.tokens_on_time) == (1, 1, 6, 5)
    assert st.gap_max_s == pytest.approx(11.5 - 10.45) and st.gap_p50_s == pytest.approx(0.01)
    assert sum(st.gap_counts) == 6 and st.gap_counts[-1] == 0 and st.gap_counts[GAP_BUCKETS_S.index(2.0)] == 1
    assert st.attainment == pytest.approx(6 / 7)
    assert t.take_window().tokens == 0 and t.totals().tokens == 6  # windows reset, totals do not


def test_late_first_token_and_unknown_ids():
    t = DeadlineTracker(DeadlineTargets(ttft_s=0.5, tpot_s=0.1))
    t.arrive("a", "m", 0.0, DeadlineTargets(ttft_s=0.2, tpot_s=0.05))  # per-call targets win
    t.emit("a", 1, 0.3)
    t.emit("ghost", 3, 0.3)
    st = t.totals()
    assert (st.first_tokens, st.first_on_time, st.ttft_attainment) == (1, 0, 0.0)
    t.finish("a")
    assert t.next_due("a") is None


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_targets_are_validated(bad):
    with pytest.raises(ValueError):
        DeadlineTargets(ttft_s=bad)
    with pytest.raises(ValueError):
        DeadlinePolicy(tpot_s=bad)


# ------------------------------------------------------------------ scheduler (virtual time, no parking)
def view(active, models, can_park=False):
    return InstanceView(active, tuple(models), None, {m.model: 0.0 for m in models}, can_park=can_park)


def test_admission_closes_so_the_urgent_model_starts_before_its_ttft():
    s = sched()
    s.tracker.arrive("a1", "A", 0.0)
    s.tracker.emit("a1", 1, 0.1)
    # A runs one call needing 5 more tokens (0.1 s); B's call is due at 1.0; a new A call wants 40 tokens.
    late_a = call("a2", "A", 0.5, prompt=50, max_tokens=40)
    b = call("b1", "B", -1.0, prompt=100)
    v = view("A", [ModelView("A", 1, 0, 5, (late_a,)), ModelView("B", 0, 0, 0, (b,))])
    d = s.decide(v, 0.2)
    assert d.phase is Phase.D and d.reason == "drain_for_deadline" and d.admit == ()
    assert s.totals["admission_closed"] == 1
    # A drained: the switch goes to B (EDF) even though A still has a queued call
    s.tracker.finish("a1")
    d = s.decide(view("A", [ModelView("A", 0, 0, 0, (late_a,)), ModelView("B", 0, 0, 0, (b,))]), 0.3)
    assert d.switch_to == "B" and d.phase is Phase.SWITCH and d.switch_path == str(SwitchPath.HOST_ONLY)


def test_without_urgency_the_active_model_admits_edf():
    s = sched()
    a2, a3 = call("a2", "A", 0.5, prompt=10), call("a3", "A", 0.2, prompt=10)
    d = s.decide(view("A", [ModelView("A", 0, 0, 0, (a2, a3)), ModelView("B")]), 0.6)
    assert d.phase is Phase.P and d.admit == ("a3", "a2") and d.run_step


def test_prefill_that_would_stall_running_tokens_waits_for_slack():
    s = sched()
    s.tracker.arrive("r", "A", 0.0)
    s.tracker.emit("r", 1, 0.0)  # next token due 0.1
    big = call("big", "A", 0.0, prompt=500)  # 0.5 s of prefill, due at 2.0
    v = view("A", [ModelView("A", 1, 0, 50, (big,)), ModelView("B")])
    assert s.decide(v, 0.01).admit == ()  # slack 0.09 < 0.52: decode first
    for k in range(1, 10):  # the running call decodes ahead of its deadlines: slack builds up
        s.tracker.emit("r", 1, 0.01 * k)
    assert s.tracker.slack("r", 0.1) == pytest.approx(0.9)
    assert s.decide(v, 0.1).admit == ("big",)


def test_edf_across_models_and_epoch_summary_carries_deadline_stats():
    s = sched()
    b, c = call("b", "B", 0.3), call("c", "C", 0.1)
    d = s.decide(view(None, [ModelView("A"), ModelView("B", queued=(b,)), ModelView("C", queued=(c,))]), 0.5)
    assert d.switch_to == "C"
    s.observe_switch(SwitchPath.HOST_ONLY, 0.5)
    s.tracker.arrive("c", "C", 0.1)
    s.tracker.emit("c", 1, 1.2)
    d = s.decide(view("C", [ModelView("A"), ModelView("B", queued=(b,)), ModelView("C", 1, 0, 3)]), 1.2)
    assert d.phase is Phase.D  # C's call is running: no parking, so C decodes
    s.tracker.finish("c")
    d = s.decide(view("C", [ModelView("A"), ModelView("B", queued=(b,)), ModelView("C")]), 1.3)
    assert d.switch_to == "B"
    (summ,) = s.take_summaries()
    assert summ.flags["token_deadlines"] and summ.switch_paths == ("host_only",)
    assert summ.deadlines.first_tokens == 1 and summ.deadlines.first_on_time == 1
    assert summ.wall_s == pytest.approx(summ.active_s + summ.switch_s)
    st = s.status(1.3)
    assert st["mode"] == "token_deadlines" and st["switches"] == 2 and st["ttft_attainment"] == 1.0


# ------------------------------------------------------------------ scheduler with parking (policy only)
def _parked_view(slack_tokens: int):
    s = sched()
    s.tracker.arrive("r", "A", 0.0)
    for k in range(1 + slack_tokens):
        s.tracker.emit("r", 1, 0.001 * k)  # tokens generated far ahead of their 0.1 s spacing
    b = call("b", "B", -1.25, prompt=50)  # due 0.75, needs 0.57 (switch 0.5 + prefill 0.05 + step): start by 0.18
    return s, view("A", [ModelView("A", 1, 0, 100), ModelView("B", queued=(b,))], can_park=True)


def test_parking_switch_spends_buffered_slack_only_when_every_sequence_keeps_its_deadline():
    s, v = _parked_view(slack_tokens=20)  # slack 2.0 s covers switch 0.5 + B 0.07 + back 0.5 + step
    assert s.decide(v, 0.05).phase is Phase.D  # not urgent yet: one more A token still lets B in on time
    d = s.decide(v, 0.17)  # one more A token would make B late (B can still make it): switch, parking A
    assert d.switch_to == "B"
    s, v = _parked_view(slack_tokens=3)  # slack 0.3 s cannot cover the round trip: denied, A keeps decoding
    d = s.decide(v, 0.17)
    assert d.phase is Phase.D and d.reason == "switch_denied" and s.totals["denied_switches"] == 1


# ------------------------------------------------------------------ intake validation of per-call hints
@pytest.mark.parametrize("field,val", [("ttft_target_s", -1.0), ("tpot_target_s", math.nan), ("ttft_target_s", 1e9)])
def test_hint_validation_is_a_400_naming_the_field(field, val):
    from services.engine.api import InvalidRequestError
    from services.engine.executor import validate_request
    from services.engine.types import EngineRequest

    req = EngineRequest("r", [1, 2], **{field: val})
    with pytest.raises(InvalidRequestError) as e:
        validate_request(req, 100, 50)
    assert e.value.status == 400 and e.value.param == field
    validate_request(EngineRequest("r", [1, 2], ttft_target_s=0.5, tpot_target_s=0.05), 100, 50)


def test_calls_already_lost_do_not_preempt_calls_that_can_still_be_on_time():
    s = sched()
    lost = call("lost", "B", -5.0)  # due -3.0: late whatever happens
    ok = call("ok", "C", 0.0)  # due 2.0: on time if served now
    v = view(None, [ModelView("A"), ModelView("B", queued=(lost,)), ModelView("C", queued=(ok,))])
    assert s.decide(v, 0.0).switch_to == "C"
    v = view("C", [ModelView("A"), ModelView("B", queued=(lost,)), ModelView("C")])
    assert s.decide(v, 0.5).switch_to == "B"  # nothing on time waits: the late call is still served


def test_wire_and_config_carry_token_deadlines():
    from services.engine import wire
    from services.engine.cold.slotted import policy_from_config
    from talaria.config import EngineConfig

    s = sched()
    s.decide(view(None, [ModelView("A", queued=(call("a", "A", 0.0),))]), 0.0)
    s.tracker.arrive("a", "A", 0.0)
    s.tracker.emit("a", 2, 0.5)
    s._open_epoch("A", 1.0)  # closes the epoch opened by the first switch
    (summ,) = s.take_summaries()
    msg = wire.round_summary(summ, "cold-0")
    assert msg.cold_scheduler == "token_deadlines" and msg.token_deadlines.first_tokens == 1 and msg.token_deadlines.tokens == 1
    assert list(msg.token_deadlines.gap_bucket_le_s)[-1] == 0.0 and sum(msg.token_deadlines.gap_bucket_count) == 1
    cfg = EngineConfig(id="e", pool="cold", models=["a", "b"], token_deadlines=True, slot_ttft_s=3.0)
    pol = policy_from_config(cfg)
    assert pol.token_deadlines and pol.ttft_s == 3.0 and not EngineConfig(id="e", pool="cold", models=["a"]).token_deadlines
