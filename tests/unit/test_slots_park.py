"""Slot scheduler with an executor that can park (``InstanceView.can_park``, the simulator's model of the
paper's engine, Talaria §5.5): the slot closes at its budget with calls still decoding; without parking
(this codebase's engine) Dfin drains them first."""

from __future__ import annotations

from services.engine.slots import CallView, CostModel, CostProfile, InstanceView, ModelView, Phase, SlotPolicy, SlotScheduler

COSTS = CostProfile(prefill_per_token=1e-4, decode_step=0.01, restore_per_token=1e-5,
                    switch_by_path={"full_staged": 0.05, "partial": 0.2, "host_only": 0.4})


def _views(can_park: bool):
    qa = CallView("a#0", "a", 0.0, 100, 10_000, "sa", 0, "missing", False)
    qb = CallView("b#0", "b", 0.0, 100, 4, "sb", 0, "missing", False)
    start = InstanceView("a", (ModelView("a", queued=(qa,)), ModelView("b", queued=(qb,))), can_park=can_park)
    decoding = InstanceView("a", (ModelView("a", running=1, max_remaining_decode=9_000), ModelView("b", queued=(qb,))), can_park=can_park)
    return start, decoding


def _run(can_park: bool):
    s = SlotScheduler(SlotPolicy(ttft_s=2.0, tpot_s=0.1, gamma=0.8), CostModel(COSTS))
    start, decoding = _views(can_park)
    first = s.decide(start, 0.0)
    assert first.phase is Phase.P and first.admit == ("a#0",)
    out = []
    t = 0.01
    while t < 5.0:  # a's slot budget is < gamma * ttft = 1.6 s
        d = s.decide(decoding, t)
        out.append((t, d))
        if d.switch_to is not None:
            break
        t += 0.01
    return out


def test_parking_executor_closes_the_slot_at_its_budget():
    out = _run(can_park=True)
    t, last = out[-1]
    assert last.switch_to == "b" and last.phase is Phase.SWITCH
    assert t < 1.7  # at the slot budget, not after the 9,000-token drain


def test_draining_executor_keeps_decoding_past_the_budget():
    out = _run(can_park=False)
    assert all(d.switch_to is None for _, d in out)  # 5 s of decode boundaries, still draining
    assert out[-1][1].reason == "dfin_drain" and out[-1][1].run_step
