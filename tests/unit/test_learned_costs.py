"""Costs learned from reality (issue 12 #2): prefill seconds per token by context length and decode-step
seconds by batch size, measured by real engines doing real work, published in the heartbeat and read by the
router's profile book (through the gateway, as over NATS) and by the slot scheduler's cost model. The learned
values must differ from the priors and equal what the measured steps give (replayed exactly)."""

from __future__ import annotations

import pytest

from talaria.cost_curve import CostCurve, bucket, prefill_seconds

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_cost_curve_buckets_interpolates_and_keeps_the_prior_until_measured():
    c = CostCurve(prior=7.0, alpha=1.0)
    assert not c.measured and c.value(123) == 7.0
    assert [bucket(x) for x in (0, 1, 2, 3, 100, 128, 129)] == [1, 1, 2, 4, 128, 128, 256]
    c.observe(100, 1.0)  # bucket 128
    c.observe(2000, 3.0)  # bucket 2048
    assert c.value(128) == 1.0 and c.value(2048) == 3.0
    assert c.value(10) == 1.0 and c.value(10**6) == 3.0  # flat beyond the measured range
    assert c.value(512) == pytest.approx(2.0)  # log-linear between 128 and 2048
    assert prefill_seconds(c, 9.0, 100, 150) == pytest.approx(100 * c.value(100))
    assert prefill_seconds(None, 9.0, 100, 150) == 900.0  # no curve: the scalar arithmetic
    d = CostCurve(0.0)
    d.load(c.points())
    assert d.points() == [(128, 1.0, 1), (2048, 3.0, 1)]


def _replay(samples) -> tuple[CostCurve, CostCurve]:
    p, d = CostCurve(0.0), CostCurve(0.0)
    for kind, size, seconds in samples:
        (p if kind == "prefill" else d).observe(size, seconds)
    return p, d


def test_router_learns_the_hot_engines_measured_curves_from_its_heartbeat(synth_models):
    from services.engine import wire
    from services.engine.executor import Engine
    from services.engine.types import SamplingParams
    from services.router.gateway import Gateway, PoolSpec
    from services.router.leases import LeaseTable
    from services.router.policy import PolicyParams
    from services.router.profiles import Defaults, ShapeBook
    from services.router.registry import Registry
    from services.router.sessions import SessionTable
    from talaria.clock import ManualClock
    from talaria.config import EngineConfig
    from talaria.v1 import engine_pb2 as pb

    eng = Engine(synth_models["tiny-llama"], page_size=4, max_num_batched_tokens=256, dtype="float32")
    eng.generate([list(range(3, 23))], SamplingParams(max_tokens=3, **GREEDY))  # short context, batch 1
    eng.generate([list(range(5, 5 + 200))], SamplingParams(max_tokens=2, **GREEDY))  # long context (chunked)
    eng.generate([list(range(i, i + 12)) for i in range(4)], SamplingParams(max_tokens=4, **GREEDY))  # batch 4
    exp_p, exp_d = _replay(eng.meter.step_samples)
    assert len(exp_p.points()) >= 2 and {1, 4} <= {b for b, _s, _n in exp_d.points()}
    assert eng.meter.prefill_curve.points() == exp_p.points() and eng.meter.decode_curve.points() == exp_d.points()

    cfg = EngineConfig(id="e0", models=["tiny-llama"])
    snap = wire.instance_snapshot(cfg, eng.stats(), [], epoch=1, seq=1, draining=False, rounds=0)
    snap.sent_unix = 0.0
    snap = pb.InstanceSnapshot.FromString(snap.SerializeToString())  # over the wire
    clock = ManualClock()
    reg = Registry(clock, miss_limit=3, stale_after=2, wall=clock.now)
    gw = Gateway(PolicyParams(), reg, SessionTable(clock), LeaseTable(), clock.now, tau_s=0,
                 pools={"e0": PoolSpec("hot", ("tiny-llama",), 4)}, shapes=ShapeBook())
    assert gw.on_snapshot(snap)
    prof = gw.profiles.profile("e0")
    for got, exp in ((prof.prefill_by_context, exp_p), (prof.decode_by_batch, exp_d)):
        assert [(b, n) for b, _s, n in got.points()] == [(b, n) for b, _s, n in exp.points()]
        assert [s for _b, s, _n in got.points()] == pytest.approx([s for _b, s, _n in exp.points()], rel=1e-12)
    prior = Defaults()
    for b, s, _n in exp_d.points():
        assert prof.decode_step_at(b) == pytest.approx(s) and s != prior.decode_step
    for b, s, _n in exp_p.points():
        assert prof.prefill_s(10, b + 5) == pytest.approx(10 * s) and s != prior.prefill_per_token


def test_slot_scheduler_learns_curves_from_a_real_cold_engines_steps(synth_models):
    from services.engine.slots import CostModel, CostProfile, SlotPolicy
    from services.engine.cold.engine import ColdEngine
    from services.engine.cold.slotted import SlotSwitching
    from services.engine.types import EngineRequest, SamplingParams

    prior = CostProfile(prefill_per_token=123.0, decode_step=77.0, restore_per_token=5.0)
    ce = ColdEngine(
        {m: synth_models[m] for m in ("tiny-llama", "tiny-qwen2")}, switching=SlotSwitching(SlotPolicy(ttft_s=1e6, tpot_s=1e5), CostModel(prior)),
        page_size=4, kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024,
    )
    seen = []
    observe = ce.switching.slots.observe_shape

    def spy(*a):  # records what the engine measured, then learns it as usual
        seen.append(a)
        observe(*a)

    ce.switching.slots.observe_shape = spy
    sp = SamplingParams(max_tokens=4, **GREEDY)
    reqs = [EngineRequest(f"r{i}", list(range(i, i + n)), sp, model=m)
            for i, (n, m) in enumerate([(20, "tiny-llama"), (150, "tiny-llama"), (12, "tiny-qwen2"), (12, "tiny-llama")])]
    for r in reqs:
        ce.add_request(r)
    left = {r.request_id for r in reqs}
    for _ in range(5000):
        left -= {o.request_id for o in ce.step() if o.finished}
        if not left:
            break
    assert not left and len(ce.switch_records) >= 2

    costs = ce.switching.slots.costs
    fresh = CostModel(prior)  # replay every measured step: the learned values are exactly the measurements'
    for m, pt, pos, rt, dseq, secs in seen:
        fresh.observe_step(m, pt, rt, dseq, secs)
        fresh.observe_shape(m, pt, pos, rt, dseq, secs)
    for m in ("tiny-llama", "tiny-qwen2"):
        cur = costs.curves(m)
        assert cur == fresh.curves(m)
        assert cur["prefill_by_context"] and cur["decode_by_batch"], m
        for b, s, _n in cur["decode_by_batch"]:
            assert s != prior.decode_step and costs.decode_step_at(m, b) == s
        for b, s, _n in cur["prefill_by_context"]:
            assert s != prior.prefill_per_token
    # the scheduler prices a queued call with them, not with the prior
    from services.engine.slots.types import CallView

    c = CallView("q", "tiny-llama", 0.0, 150, 4, "", 0, "missing", False)
    assert costs.call(c).seconds < 150 * prior.prefill_per_token / 1000


def _cold_snapshot(ce, iid: str, models, seq: int = 1):
    from services.engine import wire
    from talaria.config import EngineConfig
    from talaria.v1 import engine_pb2 as pb

    snap = wire.instance_snapshot(EngineConfig(id=iid, pool="cold", models=list(models)), ce.stats(), [], epoch=1, seq=seq,
                                  draining=False, rounds=0)
    snap.sent_unix = 0.0
    return pb.InstanceSnapshot.FromString(snap.SerializeToString())  # over the wire


def test_router_prices_each_model_of_a_cold_instance_with_that_models_own_measured_costs(synth_models):
    """Issue 12: a cold instance's profile is its active model's; a call of another model is priced with that
    model's own costs from the heartbeat (``ModelState.cost``), and a peer that has not run the model yet
    borrows them, never another model's."""
    from services.engine.cold.engine import ColdEngine
    from services.engine.types import EngineRequest, SamplingParams
    from services.router.gateway import Gateway, PoolSpec
    from services.router.leases import LeaseTable
    from services.router.policy import PolicyParams, model_profile
    from services.router.profiles import ShapeBook
    from services.router.registry import Registry
    from services.router.sessions import SessionTable
    from talaria.clock import ManualClock

    models = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
    a = ColdEngine({m: synth_models[m] for m in models}, page_size=4, kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
    b = ColdEngine({m: synth_models[m] for m in models}, page_size=4, kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
    sp = SamplingParams(max_tokens=3, **GREEDY)

    def run(ce, calls):
        for i, (m, n) in enumerate(calls):
            ce.add_request(EngineRequest(f"{m}-{i}", list(range(3, 3 + n)), sp, model=m))
            while ce.has_unfinished():
                ce.step()

    run(a, [("tiny-llama", 120), ("tiny-qwen2", 12)])  # a: llama measured at a long context, then qwen2 active
    run(b, [("tiny-qwen3", 12)])  # b: only qwen3
    assert a.active == "tiny-qwen2" and b.active == "tiny-qwen3"
    sa, sb = _cold_snapshot(a, "a", models), _cold_snapshot(b, "b", models)
    own = {m.model: m for m in sa.models}
    llama = a._shells["tiny-llama"].engine.cost_stats()
    assert [(c.at, c.seconds, c.samples) for c in own["tiny-llama"].cost.prefill_by_context] == list(llama.prefill_by_context)
    assert list(llama.prefill_by_context) != list(a._shells["tiny-qwen2"].engine.cost_stats().prefill_by_context)
    assert not own["tiny-qwen3"].HasField("cost")  # never activated on a: nothing measured there

    clock = ManualClock()
    reg = Registry(clock, miss_limit=3, stale_after=2, wall=clock.now)
    gw = Gateway(PolicyParams(), reg, SessionTable(clock), LeaseTable(), clock.now, tau_s=0,
                 pools={i: PoolSpec("cold", models, 4) for i in ("a", "b")}, shapes=ShapeBook())
    assert gw.on_snapshot(sa) and gw.on_snapshot(sb)
    gw.on_snapshot(_cold_snapshot(a, "a", models, seq=2))  # a again, after its peer b reported
    states = {st.instance_id: st for st in gw.instance_states()}
    sta, stb = states["a"], states["b"]

    def points(p):
        return [(x, n) for x, _s, n in p.prefill_by_context.points()]

    # a prices llama with llama's own curve, not with its instance profile (the active qwen2's)
    assert points(model_profile(sta, "tiny-llama")) == [(x, n) for x, _s, n in llama.prefill_by_context]
    assert points(sta.profile) != points(model_profile(sta, "tiny-llama"))
    # b never ran llama: it borrows a's llama costs; a never ran qwen3: it borrows b's
    assert points(model_profile(stb, "tiny-llama")) == points(model_profile(sta, "tiny-llama"))
    qwen3 = b._shells["tiny-qwen3"].engine.cost_stats()
    assert points(model_profile(sta, "tiny-qwen3")) == [(x, n) for x, _s, n in qwen3.prefill_by_context]
    assert model_profile(sta, "tiny-qwen3").prefill_s(100, 100) == pytest.approx(model_profile(stb, "tiny-qwen3").prefill_s(100, 100))
    # switch costs stay the instance's
    assert model_profile(sta, "tiny-llama").switch_s == sta.profile.switch_s
