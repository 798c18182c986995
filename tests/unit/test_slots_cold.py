"""The slot scheduler on the real cold engine: interleaved sessions of three tiny models all complete, with
outputs identical to single-model runs; SP captures returns inside the active slot; Round-only does not."""

from __future__ import annotations

import random

import pytest

from services.engine.executor import Engine
from services.engine.slots import Phase, SlotPolicy
from services.engine.cold.engine import ColdEngine
from services.engine.cold.slotted import SlotSwitching
from services.engine.types import EngineRequest, SamplingParams
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture

PAGE = 4
MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
STEP_S = 0.01  # unit of the tool gaps (virtual seconds)
TICK_S = 0.002  # virtual time that passes on every clock read (so steps and switches take time)


class StepClock:
    """Deterministic virtual clock: every read advances it a tick."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += TICK_S
        return self.t


def sessions_spec(seed=0, per_model=2, depth=3):
    rng = random.Random(seed)
    out = []
    for m in MODELS:
        for j in range(per_model):
            first = [rng.randrange(3, 200) for _ in range(rng.randint(6, 14))]
            extras = [[rng.randrange(3, 200) for _ in range(rng.randint(2, 6))] for _ in range(depth - 1)]
            out.append({"sid": f"{m}-{j}", "model": m, "first": first, "extras": extras,
                        # session 0 of a model decodes long, the others return quickly while it runs (SP)
                        "max_tokens": [rng.randint(16, 24) if j == 0 else rng.randint(3, 6) for _ in range(depth)],
                        "gaps": [rng.randint(1, 2) for _ in range(depth)]})
    return out


def reference(synth_models, specs):
    """Each session alone on a fresh single-model Engine: prompt_k+1 = prompt_k + output_k + extra_k."""
    engines = {m: Engine(synth_models[m], page_size=PAGE, num_pages=256) for m in MODELS}
    ref = {}
    for s in specs:
        eng, prompt, outs = engines[s["model"]], list(s["first"]), []
        for k, mt in enumerate(s["max_tokens"]):
            toks = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True))[0]
            outs.append(toks)
            if k < len(s["extras"]):
                prompt = prompt + toks + s["extras"][k]
        ref[s["sid"]] = outs
    return ref


def run_interleaved(ce: ColdEngine, clock: StepClock, specs):
    """Closed loop in virtual time: a session's next call arrives ``gap`` steps after its previous one ended."""
    state = {s["sid"]: {"k": 0, "prompt": list(s["first"]), "outs": [], "due": 0} for s in specs}
    by_id = {}
    decisions = []
    pending = len(specs) * len(specs[0]["max_tokens"])
    for _ in range(20000):
        for s in specs:
            st = state[s["sid"]]
            if st["due"] is not None and st["due"] <= clock.t + 1e-9 and st["k"] < len(s["max_tokens"]):
                rid = f"{s['sid']}#{st['k']}"
                sp = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"][st["k"]], ignore_eos=True)
                ce.add_request(EngineRequest(rid, list(st["prompt"]), sp, session_id=s["sid"], arrival_time=clock.t, model=s["model"]))
                by_id[rid] = (s, [])
                st["due"] = None
        if pending == 0:
            break
        outs = ce.step()
        decisions.append(ce.switching.last_decision)
        for o in outs:
            s, toks = by_id[o.request_id]
            toks += o.new_token_ids
            if o.finished:
                pending -= 1
                st = state[s["sid"]]
                st["outs"].append(list(toks))
                if st["k"] < len(s["extras"]):
                    st["prompt"] = st["prompt"] + toks + s["extras"][st["k"]]
                st["k"] += 1
                st["due"] = clock.t + s["gaps"][st["k"] - 1] * STEP_S
        ce.check_integrity()
    assert pending == 0, "replay did not finish"
    return {sid: st["outs"] for sid, st in state.items()}, decisions


def make(synth_models, policy):
    clock = StepClock()
    ce = ColdEngine(
        {m: synth_models[m] for m in MODELS}, switching=SlotSwitching(policy), clock=clock, page_size=PAGE, kv_cache_bytes=8 << 20,
        chunk_bytes=256 * 1024, runtime_bytes=64 * 1024,
    )
    return ce, clock


@pytest.fixture(scope="module")
def specs():
    return sessions_spec()


@pytest.fixture(scope="module")
def ref(synth_models, specs):
    return reference(synth_models, specs)


def test_interleaved_sessions_match_single_model_runs_with_sp(synth_models, specs, ref):
    ce, clock = make(synth_models, SlotPolicy(ttft_s=2.0, tpot_s=0.1, gamma=0.8))
    got, decisions = run_interleaved(ce, clock, specs)
    assert got == ref
    phases = {d.phase for d in decisions if d is not None}
    assert {Phase.P, Phase.SWITCH} <= phases or len(ce.switch_records) > 1
    assert len(ce.switch_records) > 3  # models really interleaved
    sums = ce.take_round_summaries()
    assert sums and all(abs(s.wall_s - s.active_s - s.switch_s) < 1e-9 for s in sums)
    assert sum(s.sp_admitted for s in sums) > 0  # returns captured inside the active slot
    st = ce.stats().slots
    assert st is not None and st.rounds == len(sums) and st.shortfall_s >= 0


def test_round_only_matches_too_and_never_sp(synth_models, specs, ref):
    ce, clock = make(synth_models, SlotPolicy.round_only(ttft_s=2.0, tpot_s=0.1, gamma=0.8))
    got, decisions = run_interleaved(ce, clock, specs)
    assert got == ref
    assert not any(d is not None and d.phase is Phase.SP for d in decisions)
    assert all(r.path == "host_only" for r in list(ce.switch_records)[1:])


def test_ablation_switches_from_engine_config():
    from talaria.config import EngineConfig
    from services.engine.cold.slotted import policy_from_config

    off = policy_from_config(EngineConfig(id="e", pool="cold", models=["a", "b"], sp=False, host_kv=False, d2d_staging=False))
    assert off.flags == SlotPolicy.round_only().flags == {"sp": False, "host_kv": False, "d2d_staging": False, "return_hold": False}
    on = policy_from_config(EngineConfig(id="e", pool="cold", models=["a", "b"], slot_ttft_s=3.0, slot_gamma=0.5))
    assert not policy_from_config(EngineConfig(id="e", pool="cold", models=["a", "b"], return_hold=False)).return_hold
    assert on.flags == {"sp": True, "host_kv": True, "d2d_staging": True, "return_hold": True} and on.ttft_s == 3.0 and on.gamma == 0.5


def test_token_deadline_mode_matches_and_reports_attainment(synth_models, specs, ref):
    """issue 16: the Aegaeon-style token-deadline scheduler drives the same engine; outputs are identical and
    every token is scored (rounds mode scores them too, so the two can be compared side by side)."""
    ce, clock = make(synth_models, SlotPolicy(ttft_s=2.0, tpot_s=0.1, gamma=0.8, token_deadlines=True))
    got, decisions = run_interleaved(ce, clock, specs)
    assert got == ref
    assert len(ce.switch_records) > 3 and ce.switching.slots.totals["switches"] == len(ce.switch_records) - 1  # all EDF switches
    assert {d.phase for d in decisions if d is not None} <= {Phase.P, Phase.D, Phase.DFIN, Phase.IDLE}
    sums = ce.take_round_summaries()
    assert sums and all(s.flags["token_deadlines"] and s.deadlines is not None for s in sums)
    total = ce.switching.deadlines.totals()
    n_tokens = sum(len(t) for outs in ref.values() for t in outs)
    assert total.first_tokens + total.tokens == n_tokens and sum(total.gap_counts) == total.tokens
    st = ce.stats().slots
    assert st.mode == "token_deadlines" and 0.0 <= st.attainment <= 1.0


def test_per_call_deadline_hints_override_the_configured_targets(synth_models):
    """issue 16: GenerateRequest.ttft_target_s / tpot_target_s reach the tracker (0 = the configured targets)."""
    ce, clock = make(synth_models, SlotPolicy(ttft_s=100.0, tpot_s=100.0, token_deadlines=True))
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ce.add_request(EngineRequest("tight", [5, 6, 7], sp, arrival_time=clock.t, model=MODELS[1], ttft_target_s=1e-6))
    ce.add_request(EngineRequest("loose", [5, 6, 7], sp, arrival_time=clock.t, model=MODELS[1]))
    while ce.has_unfinished():
        ce.step()
    t = ce.switching.deadlines.totals()
    assert (t.first_tokens, t.first_on_time) == (2, 1)  # only the hinted call missed its first token


def test_heartbeat_carries_each_models_predicted_slot_wait(synth_models):
    """Issue 12: with one model's slot open and another model's call queued, the real cold engine's stats (and
    so its heartbeat) give the active model no wait and the queued one the rest of the slot plus a switch."""
    from services.engine import wire
    from talaria.config import EngineConfig
    from talaria.v1 import engine_pb2 as pb

    ce, clock = make(synth_models, SlotPolicy(ttft_s=2.0, tpot_s=0.1, gamma=0.8))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ce.add_request(EngineRequest("first", [5, 6, 7, 8], sp, arrival_time=clock.t, model=MODELS[0]))
    ce.add_request(EngineRequest("other", [5, 6, 7, 8], sp, arrival_time=clock.t, model=MODELS[1]))
    finished: set[str] = set()
    for _ in range(50):
        finished |= {o.request_id for o in ce.step() if o.finished}
        st = ce.stats()
        if st.slots is not None and dict(st.slots.slot_wait_s).get(MODELS[0]) == 0.0 and ce.active == MODELS[0]:
            break
    else:
        pytest.fail("no slot of the first model opened")
    waits = {m.model: m.slot_wait_s for m in st.models}
    assert waits[MODELS[0]] == 0.0 and waits[MODELS[1]] > 0.0, waits
    cfg = EngineConfig(id="c0", pool="cold", models=list(MODELS))
    snap = pb.InstanceSnapshot.FromString(wire.instance_snapshot(cfg, st, [], epoch=1, seq=1, draining=False, rounds=0).SerializeToString())
    assert {m.model: m.slot_wait_s for m in snap.models} == pytest.approx(waits)
    # step until both calls are done, and no further: ``has_unfinished`` stays true while the engine stages the
    # next model's weights, and each of those steps' decisions (no work) closes the slot this part looks at
    for _ in range(200):
        if finished >= {"first", "other"}:
            break
        finished |= {o.request_id for o in ce.step() if o.finished}
    else:
        pytest.fail(f"the calls did not finish: {finished}")
    # idle with the last slot still open (no decision runs without work): the next decision closes it, so no
    # model waits for it (the router prices the switch alone), never for the rest of the slot's budget
    idle = ce.stats()
    assert ce.switching.slots._slot is not None and ce.switching.slots._slot.budget_s > 0
    assert dict(idle.slots.slot_wait_s) == {} and all(m.slot_wait_s == 0.0 for m in idle.models)
