"""The indexed placement path (``policy.InstanceIndex``, replica shortlist, precomputed per-snapshot terms)
against a straightforward reference: ``breakdown`` + ``apply_eq2`` over every instance serving the model.
With the shortlist bound >= the number of instances the decisions must be identical (instance, reason,
lease outcome and every cost breakdown, bit for bit); below it, only replica-opening instances may be
left out."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.policy import (
    KV_DEVICE,
    KV_HOST,
    CallRequest,
    CallShape,
    InstanceIndex,
    InstanceState,
    LeaseView,
    ModelRes,
    PlacementState,
    PolicyParams,
    Profile,
    SessionView,
    apply_eq2,
    breakdown,
    decide,
    lease_check,
)

MODELS = ("m", "n")


def reference(state: PlacementState, now: float):
    """Algorithm 1 evaluated plainly over all instances (the pre-index implementation)."""
    m = state.request.model
    serving = [i for i in state.instances if m in i.models]
    lease = lease_check(state, now)
    if lease == "hit":
        inst = next(i for i in serving if i.instance_id == state.lease.instance_id)
        mine = breakdown(inst, state)
        # the lease arithmetic (issue 12): outweighed when another admissible instance is cheaper by Eq. 1
        # (the lease still discounted on its own instance)
        others = apply_eq2([breakdown(i, state) for i in serving], {i.instance_id: i for i in serving}, state)
        best = min((c for c in others if not c.reject and c.instance_id != inst.instance_id),
                   key=lambda c: (c.total, c.instance_id), default=None)
        if not state.params.lease_arithmetic or best is None or best.total >= mine.total:
            return "lease", inst.instance_id, lease, (mine,)
        lease = "outweighed"
    if lease != "none":
        state = replace(state, lease=None)
    costs = tuple(apply_eq2([breakdown(i, state) for i in serving], {i.instance_id: i for i in serving}, state))
    ok = [c for c in costs if not c.reject]
    if not ok:
        live = any(c.reject not in ("unhealthy", "stale") for c in costs)
        return ("overload" if live else "no-instance"), None, lease, costs
    return "cost", min(ok, key=lambda c: (c.total, c.instance_id)).instance_id, lease, costs


res = st.builds(ModelRes, loaded=st.booleans(), active=st.booleans(), staged=st.booleans())


def _curve(points):  # issue 12: learned curves go through the fast path and _terms alike
    from talaria.cost_curve import CostCurve

    c = CostCurve(0.0)
    c.load(points)
    return c


PREFILL_CURVE = _curve([(16, 1e-4, 3), (512, 3e-4, 2), (4096, 1e-3, 1)])
DECODE_CURVE = _curve([(1, 0.01, 4), (8, 0.04, 2)])
prof = st.builds(
    Profile,
    prefill_per_token=st.sampled_from([1e-4, 2.5e-4, 1e-3]),
    decode_step=st.sampled_from([0.01, 0.03]),
    restore_per_token=st.sampled_from([1e-5, 1e-4]),
    switch_s=st.sampled_from([0.2, 0.5]),
    staged_switch_s=st.sampled_from([0.1, 0.2]),
    open_s=st.sampled_from([0.0, 3.0, 5.0]),
    prefill_by_context=st.sampled_from([None, PREFILL_CURVE]),
    decode_by_batch=st.sampled_from([None, DECODE_CURVE]),
)
kv_entry = st.tuples(st.sampled_from([0, KV_DEVICE, KV_HOST]), st.sampled_from([0, 500, 2000]))


@st.composite
def instance(draw, iid: str) -> InstanceState:
    models = draw(st.dictionaries(st.sampled_from(MODELS), res, min_size=0, max_size=2))
    kv = {}
    for m in MODELS:
        if draw(st.booleans()):
            kv[("s", m)] = draw(kv_entry)
    if draw(st.booleans()):
        kv[("other", "m")] = (KV_DEVICE, 800)
    return InstanceState(
        instance_id=iid,
        healthy=draw(st.booleans()) or draw(st.booleans()),
        fresh=draw(st.booleans()) or draw(st.booleans()),
        models=models,
        profile=draw(prof),
        kv=kv,
        running=draw(st.integers(0, 6)),
        waiting=draw(st.integers(0, 6)),
        overlay_calls=draw(st.integers(0, 3)),
        overlay_leases=draw(st.integers(0, 2)),
        kv_pages_total=draw(st.sampled_from([0, 40, 200, 10_000])),
        page_size=draw(st.sampled_from([0, 1, 16])),
        kv_usage=draw(st.sampled_from([0.0, 0.3, 0.97, 1.0])),
        snapshot_unix=draw(st.sampled_from([0.0, 5.0, 10.0])),
        epoch=draw(st.sampled_from([0, 1, 2])),
    )


@st.composite
def placement(draw) -> tuple[PlacementState, float]:
    n = draw(st.integers(1, 12))
    ids = draw(st.permutations([f"i{k}" for k in range(n)]))
    insts = [draw(instance(iid)) for iid in ids]
    model = draw(st.sampled_from(MODELS))
    session = None
    if draw(st.booleans()):
        session = SessionView(draw(st.sampled_from(MODELS)), draw(st.sampled_from(ids)), draw(st.sampled_from(ids)),
                              draw(st.sampled_from([0, 700, 2000])), draw(st.sampled_from([0.0, 6.0, 11.0])))
    lease = None
    if draw(st.booleans()):
        lease = LeaseView("L", draw(st.sampled_from(ids)), draw(st.sampled_from(MODELS)), draw(st.sampled_from([0, 800])),
                          t_done_unix=draw(st.sampled_from([1.0, 8.0])), t_exp_unix=draw(st.sampled_from([9.0, 20.0])),
                          epoch=draw(st.sampled_from([0, 1, 2])))
    params = PolicyParams(
        admission_unit=draw(st.sampled_from([0.0, 1.0])),
        admission_budget_s=draw(st.sampled_from([0.5, 5.0, 60.0])),
        hbm_reserve_fraction=draw(st.sampled_from([0.0, 0.2])),
        hbm_price_s_per_gib=draw(st.sampled_from([0.0, 0.05, 1.0])),
        replica_penalty_s=draw(st.sampled_from([0.0, 1.0])),
        model_weights_gib=draw(st.sampled_from([{}, {"m": 4.0}])),
        replica_shortlist=draw(st.sampled_from([0, n, n + 5])),  # 0 = unbounded; else >= number of instances
        lease_arithmetic=draw(st.booleans()),
        charge_imposed=draw(st.booleans()),
        imposed_prefill=draw(st.booleans()),
    )
    req = CallRequest(draw(st.sampled_from(["s", "", "new"])), model, draw(st.sampled_from([1, 600, 3000])),
                      draw(st.sampled_from([1, 128])), draw(st.sampled_from([0.0, 64.0])))
    shape = CallShape(draw(st.sampled_from([1.0, 256.0])), draw(st.sampled_from([10.0, 512.0])), draw(st.sampled_from([1.0, 64.0])))
    demand = {model: draw(st.sampled_from([0.0, 3.0, 40.0]))}
    state = PlacementState(req, insts, params, session=session, lease=lease, shape=shape, demand=demand)
    return state, draw(st.sampled_from([0.0, 8.5, 15.0]))


@settings(max_examples=300, deadline=None)
@given(placement())
def test_indexed_decision_equals_reference_when_shortlist_covers_all(case):
    state, now = case
    reason, chosen, lease, costs = reference(state, now)
    for s in (state, _with_incremental_index(state)):
        d = decide(s, now)
        assert (d.reason, d.instance_id, d.lease) == (reason, chosen, lease)
        assert d.costs == costs  # every breakdown, same order, bit-identical floats
        assert d.shortlisted_out == 0


def _with_incremental_index(state: PlacementState) -> PlacementState:
    """A prebuilt full index reached by updates (as the gateway keeps it), not by one build."""
    idx = InstanceIndex(state.params)
    for i in state.instances:  # stale versions first, then the real ones replace them
        idx.put(replace(i, waiting=i.waiting + 7, kv={}, healthy=not i.healthy, models={"n": ModelRes()}))
    for i in state.instances:
        idx.put(i)
    idx.put(InstanceState("gone", True, True, {"m": ModelRes()}, state.instances[0].profile))
    idx.remove("gone")
    return replace(state, index=idx, index_version=idx.version)


@settings(max_examples=150, deadline=None)
@given(placement(), st.integers(1, 3))
def test_shortlist_below_instance_count_only_drops_replica_openers(case, k):
    state, now = case
    state = replace(state, params=replace(state.params, replica_shortlist=k))
    costs = reference(state, now)[3]
    d = decide(state, now)
    if d.reason == "lease":
        return
    kept = {c.instance_id for c in d.costs}
    dropped = [c for c in costs if c.instance_id not in kept]
    assert len(dropped) == d.shortlisted_out
    assert all(c.act == "open" for c in dropped)
    ref = {c.instance_id: c for c in costs}
    for c in d.costs:  # what is ranked is ranked exactly as the reference ranks it (Eq. 1 and checks)
        assert c[:11] == ref[c.instance_id][:11]


def test_gateway_incremental_index_matches_a_fresh_evaluation():
    """Snapshots, forwards, suspicion, leases and clock advances: the gateway's incrementally kept
    states/index decide exactly as a fresh evaluation of the same instances (index rebuilt by the policy)."""
    import random

    from services.router.gateway import Gateway, PoolSpec
    from services.router.lease_service import LeaseService
    from services.router.leases import LeaseTable, MemoryLeases
    from services.router.registry import Registry
    from services.router.sessions import SessionTable
    from talaria.clock import ManualClock
    from talaria.v1 import common_pb2 as cpb
    from talaria.v1 import engine_pb2 as pb

    rng = random.Random(7)
    clock = ManualClock(100.0)
    reg = Registry(clock, miss_limit=3, stale_after=2, wall=clock.now)
    table = LeaseTable()
    store = MemoryLeases(table)
    ids = [f"c{k}" for k in range(12)]
    gw = Gateway(PolicyParams(replica_shortlist=len(ids)), reg, SessionTable(clock), table, clock.now, tau_s=1.0,
                 pools={i: PoolSpec("cold", MODELS) for i in ids})
    ls = LeaseService(gw, store)
    seqs = dict.fromkeys(ids, 0)
    for step in range(400):
        op = rng.random()
        iid = rng.choice(ids)
        if op < 0.4:
            seqs[iid] += 1
            snap = pb.InstanceSnapshot(instance_id=iid, pool=pb.POOL_COLD, epoch=1, seq=seqs[iid], sent_unix=clock.now(),
                                       heartbeat_period_s=0.5, num_running=rng.randint(0, 4), num_waiting=rng.randint(0, 4),
                                       kv_pages_total=rng.choice([0, 400]), kv_usage=rng.random())
            for m in MODELS:
                snap.models.append(pb.ModelState(model=m, loaded=rng.random() < 0.5, active=rng.random() < 0.3))
            if rng.random() < 0.5:
                snap.sessions.append(pb.SessionState(session_id=f"s{rng.randrange(4)}", model=rng.choice(MODELS), committed_tokens=900, state=pb.KV_DEVICE))
            gw.on_snapshot(snap)
        elif op < 0.55:
            reg.mark_suspect(iid, rng.choice([0.1, 1.0]))
        elif op < 0.7:
            hook = pb.CompletionHook(request_id=f"r{step}", session_id=f"s{rng.randrange(4)}", model=rng.choice(MODELS), instance_id=iid,
                                     finish_unix=clock.now(), prefix=cpb.PrefixHandle(committed_tokens=700))
            lease = ls.on_hook(hook)
            if lease is not None:
                store.install_now(lease)
        else:
            clock.advance(rng.choice([0.05, 0.3, 0.8]))
        r = gw.request(f"s{rng.randrange(5)}", rng.choice(MODELS), rng.choice([300, 1500]), 64)
        state, _ = gw.state_for(r)
        by_id = {i.instance_id: i for i in state.instances}
        assert list(by_id) == list(reg.instances)  # every instance, registry order, each state current:
        for v in reg.instances.values():
            i = by_id[v.instance_id]
            assert (i.healthy, i.fresh, i.overlay_calls, i.snapshot_unix) == (reg.healthy(v), reg.fresh(v), v.inflight, v.snapshot.sent_unix)
            assert i.overlay_leases == table.live_by_instance(clock.now()).get(v.instance_id, 0)
        fresh = replace(state, index=None, index_version=-1)
        d, ref = decide(state, clock.now()), decide(fresh, clock.now())
        assert d == ref
        if d.instance_id is not None and rng.random() < 0.5:
            gw.commit(r, d)


# ------------------------------------------------------------------- issue 15: incremental refresh
def _full_rebuild(gw) -> None:
    """Forget every cached state, index entry, lease mirror and deadline: the next decision builds all of
    them from the registry, the lease table and the profiles captured at each instance's last report."""
    from services.router.policy import InstanceIndex

    gw._index = InstanceIndex(gw.params)
    for cache in (gw._cur, gw._static, gw._states, gw._pushed, gw._recheck, gw._armed):
        cache.clear()
    gw._deadlines.clear()
    gw._lease_counts, gw._leases_synced, gw._primed = {}, False, False


def _replay(trace, gw, leases, clock, before_decide=None):
    """Feed a recorded simulator trace (snapshots, hooks, arrivals, placements) into ``gw``; returns its
    decisions, committing each as the simulator did. Counts the states built inside decisions in
    ``gw.work["decide_states_built"]``."""
    from talaria.v1 import engine_pb2 as pb

    from services.router.lease_service import LeaseService

    ls = LeaseService(gw, leases)
    out = []
    for e in trace:
        clock.advance(e["t"] - clock.now())
        if "snapshot" in e:
            gw.on_snapshot(pb.InstanceSnapshot.FromString(e["snapshot"]))
        elif "hook" in e:
            lease = ls.on_hook(pb.CompletionHook.FromString(e["hook"]))
            if lease is not None:
                leases.install_now(lease)
        elif "arrival" in e:
            ls.arrival(e["arrival"])
        else:
            req = e["place"]
            if before_decide is not None:
                before_decide(gw)
            built = gw.work["states_built"]
            d, rev = gw.decide(req)
            gw.work["decide_states_built"] += gw.work["states_built"] - built
            assert ls.settle_now(d, rev, req.session_id, req.model).stands
            out.append(d)
            if d.instance_id is not None:
                ls.commit(req, d, e["call_id"])
    return out


def test_incremental_refresh_decides_as_a_full_rebuild_on_a_recorded_cluster_trace():
    """A recorded hot/cold cluster run (60 instances, peer groups borrowing each other's costs, leases that
    expire and are consumed, heartbeats between decisions): a gateway keeping its states incrementally
    (rebuilt on heartbeats, lease-count and deadline change feeds) decides every call exactly as one that
    rebuilds every state from scratch before each decision, and as the simulator's own gateway did."""
    from sim import scale, workload
    from sim.cluster import SimConfig, Simulation
    from sim.paper import slot_policy
    from sim.profile import load
    from talaria.clock import ManualClock
    from services.router.gateway import Gateway, PoolSpec
    from services.router.leases import LeaseTable, MemoryLeases
    from services.router.profiles import DemandMeter, ProfileBook, ShapeBook
    from services.router.registry import Registry
    from services.router.sessions import SessionTable
    from pathlib import Path

    prof = load(Path(__file__).resolve().parents[2] / "profiles" / "paper-tp8.yaml")
    specs, catalog, weights = scale.cluster(60, 12)
    ss = workload.tiled(40, catalog, weights, seed=3, rate_per_s=4.0, base_sessions=20, max_depth=8)
    for s in ss:
        for c in s.calls:
            c.output_tokens = max(1, round(c.output_tokens * 0.1))
    cfg = SimConfig("trace", prof, specs, slot=slot_policy(prof), params=PolicyParams(policy="full"), tau_s=2.0, heartbeat_s=1.0,
                    decode_quantum=16, record=True)
    sim = Simulation(cfg, ss)
    sim.run()
    trace = sim._trace["router"]
    places = [e for e in trace if "place" in e]
    assert len(places) >= 150 and sum(1 for e in trace if "snapshot" in e) > 10 * len(places) / 2
    recorded = [e["decision"] for e in places]
    assert {d.lease for d in recorded} >= {"hit", "none"}

    def fresh():
        clock = ManualClock()
        table = LeaseTable()
        gw = Gateway(cfg.params, Registry(clock, miss_limit=3.0, stale_after=2.0, wall=clock.now), SessionTable(clock), table, clock.now,
                     profiles=ProfileBook(sim.gateway.profiles.defaults), shapes=ShapeBook(), demand=DemandMeter(), tau_s=cfg.tau_s,
                     pools={s.iid: PoolSpec(s.pool, s.catalog, prof.page_tokens, s.max_num_seqs) for s in specs})
        return gw, MemoryLeases(table), clock

    inc = fresh()
    got = _replay(trace, *inc)
    ref = fresh()
    full = _replay(trace, *ref, before_decide=_full_rebuild)
    assert got == full == recorded
    # a decision rebuilds what changed since the last one (forwards, completions, lease counts), not the fleet
    n = len(places)
    assert ref[0].work["decide_states_built"] == 60 * n
    assert inc[0].work["decide_states_built"] <= 3 * n
    assert inc[0].work["deadlines_void"] > n  # superseded snapshots' deadlines were skipped, not rebuilt


def test_lease_table_live_counts_equal_a_scan_at_every_now():
    """The incremental live counts (expiry heap, change feed) answer as a scan of every lease would, through
    installs, replacements, consumption, drops, prunes and a wall clock that steps back."""
    import random

    from services.router.leases import LeaseTable, lease_key
    from talaria.v1 import router_pb2 as rpb

    rng = random.Random(11)
    table = LeaseTable()
    now, mirrors = 0.0, ({}, {})  # what two consumers of the change feed (two gateways) believe

    def scan(attr):
        out = {}
        for e in table._by_key.values():
            if now < e.view.t_exp_unix:
                k = getattr(e.view, attr)
                out[k] = out.get(k, 0) + 1
        return out

    for step in range(3000):
        op = rng.random()
        sid, m, iid = f"s{rng.randrange(30)}", rng.choice("ab"), f"i{rng.randrange(6)}"
        if op < 0.4:
            table.upsert(rpb.Lease(session_id=sid, model=m, instance_id=iid, t_done_unix=now, t_exp_unix=now + rng.choice([0.0, 0.5, 1.0, 3.0])),
                         revision=rng.choice([0, step]))
        elif op < 0.55:
            table.remove(lease_key(sid, m))
        elif op < 0.6:
            table.drop_session(sid) if rng.random() < 0.5 else table.drop_instance(iid)
        elif op < 0.62:
            table.prune(now)
        else:
            now += rng.choice([0.1, 0.5, 1.0]) if rng.random() < 0.95 else -2.0
        for who, mirror in enumerate(mirrors):
            if rng.random() < 0.5:  # each consumer looks only now and then; its feed must cover everything between
                for k in table.take_live_changes(now, who):
                    mirror[k] = table.live_count(k, now)
                assert {k: n for k, n in mirror.items() if n} == scan("instance_id")
        assert table.live_by_instance(now) == scan("instance_id") and table.live_by_model(now) == scan("model")
