"""The slot hold (``slots/hold.py``) on the real cold engine: a session's retention hint (what the router sends
after installing its lease) makes the slotted engine hold its model's slot instead of switching to the model
whose call waits; the return is then served mid-slot with no switch, and its tokens are those of a run without
the hold. Virtual clocks, real tiny models."""

from __future__ import annotations

import math

import pytest

from services.engine.kv.retention import Hint, RetentionBook
from services.engine.slots import CostModel, CostProfile, Phase, SlotPolicy
from services.engine.cold.engine import ColdEngine
from services.engine.cold.slotted import SlotSwitching
from services.engine.types import EngineRequest, SamplingParams
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture
from tests.unit.test_slots_cold import PAGE, StepClock

A, B = "tiny-llama", "tiny-qwen2"
# priors of an instance whose switches are slow (the paper's regime): a round away is seconds
PRIORS = CostProfile(prefill_per_token=1e-3, decode_step=0.01, restore_per_token=1e-5,
                     switch_by_path={"full_staged": 1.0, "partial": 2.0, "host_only": 4.0})


def _sp(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _scenario(synth_models, hold: bool):
    """Session s on A: call 1 ends; a call of B is queued; the router's hint says s is back in ~0.3 s; s's
    return arrives a few steps later. Returns the engine, the decisions and s's return tokens."""
    clock = StepClock()
    wall = [1000.0]
    ce = ColdEngine({m: synth_models[m] for m in (A, B)}, switching=SlotSwitching(SlotPolicy(ttft_s=10.0, tpot_s=0.5, return_hold=hold), CostModel(PRIORS)),
                           clock=clock, page_size=PAGE, kv_cache_bytes=8 << 20,
                           chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
    book = RetentionBook(lambda: wall[0])
    ce.attach_retention(book)
    first = list(range(5, 25))
    ce.add_request(EngineRequest("s#0", first, _sp(4), session_id="s", arrival_time=clock.t, model=A))
    out0: list[int] = []
    for _ in range(200):
        wall[0] += 0.01
        for o in ce.step():
            out0 += o.new_token_ids
            if o.finished:
                break
        else:
            continue
        break
    assert len(out0) == 4 and ce.active == A
    book.note("s", Hint(wall[0], math.log(0.3), 0.3, 5.0, A))  # the router's lease: back in ~0.3 s, window 5 s
    ce.add_request(EngineRequest("b#0", list(range(30, 50)), _sp(3), session_id="t", arrival_time=clock.t, model=B))
    decisions = []
    got: dict[str, list[int]] = {"s#1": [], "b#0": []}
    for _ in range(3):  # the tool gap: three scheduler turns, 0.1 s of wall time each
        for o in ce.step():
            got[o.request_id] += o.new_token_ids
        decisions.append(ce.switching.last_decision)
        wall[0] += 0.1
        if ce.active != A:
            break
    back = first + out0 + [7, 8, 9]
    ce.add_request(EngineRequest("s#1", back, _sp(5), session_id="s", arrival_time=clock.t, model=A))
    for _ in range(400):
        for o in ce.step():
            got[o.request_id] += o.new_token_ids
        decisions.append(ce.switching.last_decision)
        wall[0] += 0.01
        if len(got["s#1"]) == 5 and len(got["b#0"]) == 3:
            break
    ce.step()  # nothing left: the round closes
    return ce, decisions, got


def test_the_slot_is_held_for_the_hinted_return_and_serves_it_without_a_switch(synth_models):
    ce, decisions, got = _scenario(synth_models, hold=True)
    assert decisions[0].phase is Phase.HOLD and decisions[0].hold_s > 0 and ce.idle_wait_s() >= 0
    sp = [i for i, d in enumerate(decisions) if d.phase is Phase.SP and "s#1" in d.admit]
    assert sp, [d.reason for d in decisions[:8]]
    assert all(d.switch_to is None for d in decisions[: sp[0]])  # A kept its slot until the return was admitted
    off_ce, off_decisions, off_got = _scenario(synth_models, hold=False)
    assert off_decisions[0].model == B and off_decisions[0].phase is Phase.P  # without the hold: B's slot at once
    assert got == off_got  # the same tokens either way
    assert len(ce.switch_records) < len(off_ce.switch_records)  # the return cost no switch back to A
    summaries = ce.take_round_summaries()
    assert sum(r.holds for r in summaries) == 1 and sum(r.phase_s.get("hold", 0.0) for r in summaries) > 0


def test_no_hint_no_hold(synth_models):
    """Without a lease's hint (or past its window) the engine switches at once, exactly as before."""
    clock = StepClock()
    ce = ColdEngine({m: synth_models[m] for m in (A, B)}, switching=SlotSwitching(SlotPolicy(ttft_s=10.0, tpot_s=0.5), CostModel(PRIORS)),
                           clock=clock, page_size=PAGE, kv_cache_bytes=8 << 20,
                           chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
    wall = [50.0]
    book = RetentionBook(lambda: wall[0])
    ce.attach_retention(book)
    ce.add_request(EngineRequest("s#0", list(range(5, 25)), _sp(2), session_id="s", arrival_time=clock.t, model=A))
    while ce.has_unfinished():
        ce.step()
    book.note("s", Hint(wall[0] - 6.0, math.log(0.3), 0.3, 5.0, A))  # its window ended a second ago
    ce.add_request(EngineRequest("b#0", list(range(30, 50)), _sp(2), session_id="t", arrival_time=clock.t, model=B))
    ce.step()
    assert ce.switching.last_decision.phase is not Phase.HOLD and ce.idle_wait_s() == 0.0
    assert ce.active == B or ce.switching.last_decision.switch_to == B
