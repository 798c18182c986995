"""Call-level time attribution (issue 12 #1): the phase clock, the wire form, the router's completion of the
split, the per-session sum, and real engines recording it — a slotted cold engine whose calls wait for their
round and a switch, and a returning session restored from a real kvstore over Mooncake."""

from __future__ import annotations

import pytest

from talaria.attribution import CallAttribution, Phase, PhaseClock, total
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from tests.unit.host_kv_fixtures import mooncake, run_calls, store  # noqa: F401 - fixtures


def test_phase_clock_charges_every_instant_to_one_phase():
    c = PhaseClock(10.0)
    c.enter(Phase.ROUND_WAIT, 10.5)
    c.enter(Phase.SWITCH_WAIT, 11.0)
    c.enter(Phase.ROUND_WAIT, 11.25)
    c.enter(Phase.ENGINE_QUEUE, 12.0)
    c.enter(Phase.RESTORE, 12.0)
    c.enter(Phase.ENGINE_QUEUE, 12.5)
    c.enter(Phase.PREFILL, 13.0)
    c.enter(Phase.DECODE, 14.0)
    c.enter(Phase.PREEMPTED, 15.0)
    c.enter(Phase.DECODE, 15.5)
    a = c.stop(17.0)
    assert a == CallAttribution(engine_queue_s=1.0, round_wait_s=1.25, switch_wait_s=0.25, restore_s=0.5, prefill_s=1.0,
                                decode_s=2.5, preemption_s=0.5, total_s=7.0)
    assert a.engine_s == pytest.approx(7.0)
    c.enter(Phase.DECODE, 99.0)  # a stopped clock ignores moves; stop is idempotent
    assert c.stop(100.0) == a


def test_explained_sets_the_residual_and_round_trips_the_wire():
    eng = CallAttribution(engine_queue_s=0.1, prefill_s=0.2, decode_s=0.3, other_s=0.05, total_s=0.65)
    a = eng.explained(1.0, router_queue_s=0.05, placement_s=0.1)
    assert a.total_s == 1.0 and a.other_s == pytest.approx(1.0 - 0.75)  # the engine's own residual is re-derived
    assert sum(a.components.values()) == pytest.approx(a.total_s)
    assert eng.explained(0.5).other_s == 0.0  # never a negative residual
    m = pb.TokenChunk(finished=True)
    m.attribution.CopyFrom(a.to_proto())
    back = pb.TokenChunk.FromString(m.SerializeToString())
    assert CallAttribution.from_proto(back.attribution) == a
    assert total([a, a]).decode_s == pytest.approx(0.6)
    assert set(a.as_dict()) == {f.name for f in cpb.CallAttribution.DESCRIPTOR.fields}  # one name on both sides


def test_router_trace_adds_queue_and_placement_and_the_record_sums_to_the_latency():
    from opentelemetry import trace

    from services.router.tracing import CallTrace

    published = []
    g = pb.GenerateRequest(request_id="r1", session_id="s", model="m")
    ct = CallTrace(trace.NoOpTracer(), g, True, "router-0", published.append)
    ct.queued(0.0)
    ct.forwarding()
    chunk = pb.TokenChunk(finished=True, finish_reason="stop")
    chunk.attribution.CopyFrom(CallAttribution(engine_queue_s=0.01, prefill_s=0.02, decode_s=0.03, total_s=0.06).to_proto())
    ct.chunk(chunk)
    ct.end()
    rec = published[-1]
    assert rec.phase == "end" and rec.HasField("attribution")
    a = CallAttribution.from_proto(rec.attribution)
    assert a.router_queue_s == 0.0 and a.decode_s == 0.03 and a.engine_queue_s == 0.01 and a.placement_s >= 0.0
    assert a.total_s == pytest.approx(rec.end_unix - rec.arrival_unix, abs=1e-6)
    if a.total_s >= 0.06 + a.placement_s:  # the engine's 0.06 s fit in the measured latency: the split is complete
        assert sum(a.components.values()) == pytest.approx(a.total_s)
    else:  # components measured elsewhere overshoot: the residual is 0, never negative
        assert a.other_s == 0.0


def test_sessions_sum_call_attributions_once_per_call():
    from services.telemetry.sessions import SessionTracker

    t = SessionTracker(idle_s=1.0)
    a = CallAttribution(decode_s=1.0, round_wait_s=0.5, total_s=1.5).as_dict()
    for rid in ("c1", "c2", "c2"):
        t.call_started("s", rid, 0.0, 0.0)
        t.call_ended("s", rid, 0.0, 2.0, 2.0)
        t.call_attribution("s", rid, 0.0, a)
    (res,) = t.expire(10.0)
    assert res.attribution["decode_s"] == 2.0 and res.attribution["round_wait_s"] == 1.0
    assert res.as_dict()["attribution"]["total_s"] == 3.0


# ------------------------------------------------------------------------- real engines
A, B = "tiny-llama", "tiny-qwen2"


def _sums(a: CallAttribution) -> None:
    assert a is not None
    assert all(v >= 0 for v in a.as_dict().values())
    assert a.engine_s == pytest.approx(a.total_s, rel=1e-9, abs=1e-9)  # exact: every instant in one phase


def test_real_cold_engine_records_round_wait_switch_wait_restore_prefill_decode(synth_models, store, mooncake):
    from services.engine.host_kv import HostKV
    from services.engine.slots import SlotPolicy
    from services.engine.cold.engine import ColdEngine
    from services.engine.cold.slotted import SlotSwitching
    from services.engine.types import EngineRequest, SamplingParams
    from services.kvstore.client import KvStoreClient

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ce = ColdEngine(
        {m: synth_models[m] for m in (A, B)}, switching=SlotSwitching(SlotPolicy(ttft_s=5.0, tpot_s=0.5)), page_size=4,
        kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024, initial=A,
    )
    ce.attach_host_kv_factory(lambda port: HostKV(port, KvStoreClient(store.address, timeout_s=2.0), mooncake=mooncake, mode="always", staging_bytes=1 << 20))
    prompt = list(range(10, 70))
    # A's call runs while B's call waits for B's slot: round wait, then the switch, then its own prefill/decode
    first = run_calls(ce, [EngineRequest("t1", prompt, greedy, session_id="s", model=A),
                      EngineRequest("b1", list(range(5, 30)), greedy, model=B)])
    t1, b1 = first["t1"].attribution, first["b1"].attribution
    _sums(t1)
    _sums(b1)
    assert t1.prefill_s > 0 and t1.decode_s > 0 and t1.switch_wait_s == 0  # (restore_s: its host lookup, a miss)
    assert b1.round_wait_s > 0 and b1.switch_wait_s > 0 and b1.prefill_s > 0 and b1.decode_s > 0
    # the switch B waited for is the one the engine recorded
    rec = [r for r in ce.recent_switch_records(4) if r.to_model == B][-1]
    assert b1.switch_wait_s == pytest.approx(rec.total_seconds, rel=0.5, abs=0.05)
    # A's session returns after B's slot: its KV left the device, the prefix is restored from the host store
    turn2 = prompt + first["t1:tokens"] + [3, 4, 5, 6]
    second = run_calls(ce, [EngineRequest("t2", turn2, greedy, session_id="s", model=A)])["t2"]
    assert second.usage.restored_tokens > 0
    t2 = second.attribution
    _sums(t2)
    assert t2.restore_s > 0 and t2.switch_wait_s > 0 and t2.prefill_s > 0 and t2.decode_s > 0


def test_real_engine_under_kv_pressure_records_time_lost_to_preemption(synth_models):
    from services.engine.executor import Engine
    from services.engine.types import EngineRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ps = [list(range(3 + i, 3 + i + 12 + 2 * i)) for i in range(8)]
    need = max(-(-(len(p) + sp.max_tokens) // 4) for p in ps)
    eng = Engine(synth_models["tiny-llama"], page_size=4, num_pages=need + 2)  # barely fits the longest call
    finals = run_calls(eng, [EngineRequest(f"p{i}", p, sp) for i, p in enumerate(ps)])
    assert eng.stats().num_preemptions > 0
    splits = [finals[f"p{i}"].attribution for i in range(len(ps))]
    for a in splits:
        _sums(a)
        assert a.prefill_s > 0 and a.decode_s > 0 and a.round_wait_s == 0 and a.switch_wait_s == 0
    assert any(a.preemption_s > 0 for a in splits)
