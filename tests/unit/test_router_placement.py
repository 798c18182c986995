"""Algorithm 1 / Eq. 1-2 of Talaria (§3.3, §4.1) under a manual clock: the pure policy and the gateway
that feeds it (no NATS, no HTTP)."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from services.router.gateway import Gateway, PoolSpec
from services.router.lease_service import LeaseService
from services.router.leases import LeaseTable, MemoryLeases
from services.router.policy import (
    KV_DEVICE,
    KV_HOST,
    CallRequest,
    InstanceState,
    LeaseView,
    ModelRes,
    PlacementState,
    PolicyParams,
    Profile,
    SessionView,
    breakdown,
    decide,
    host_prefix,
)
from services.router.profiles import ShapeBook
from services.router.registry import Registry
from services.router.sessions import SessionTable
from talaria.clock import ManualClock
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

PROF = Profile(prefill_per_token=1e-3, decode_step=0.01, restore_per_token=1e-4, switch_s=0.5, staged_switch_s=0.2, open_s=4.0)
ACTIVE = {"m": ModelRes(loaded=True, active=True)}


def inst(iid, models=ACTIVE, **kw) -> InstanceState:
    kw.setdefault("healthy", True)
    kw.setdefault("fresh", True)
    return InstanceState(instance_id=iid, models=models, profile=kw.pop("profile", PROF), **kw)


def req(session="s", model="m", prompt=1000, max_tokens=100, decode=50.0) -> CallRequest:
    return CallRequest(session, model, prompt, max_tokens, decode)


# ------------------------------------------------------------------------------ pure policy: Eq. 1


def test_eq1_terms_are_each_charged_once():
    """Prompt 1000 of which 800 are the session's prefix: the suffix is queue/prefill work, the prefix is
    KV recovery (zero / restore / recompute), activation is separate; total is their plain sum."""
    dev = inst("dev", kv={("s", "m"): (KV_DEVICE, 800)})
    host = inst("host", kv={("s", "m"): (KV_HOST, 800)})
    none = inst("none", models={"m": ModelRes(loaded=True)})  # resident, not active: a switch
    cold = inst("cold", models={"m": ModelRes()}, pool="cold")  # not resident: a full open
    session = SessionView("m", "dev", "dev", 800, 0.0)
    st = PlacementState(req(), [dev, host, none, cold], PolicyParams(replica_penalty_s=0, hbm_price_s_per_gib=0), session=session)
    d = decide(st, now=0.0)
    by = {c.instance_id: c for c in d.costs}
    suffix_work = 200 * 1e-3 + 50 * 0.01
    for c in d.costs:
        assert c.delta_r == pytest.approx(c.queue_s + suffix_work)  # never the prefix, never activation
        assert c.total == pytest.approx(c.delta_r + c.c_kv + c.c_act)
    assert (by["dev"].kv_source, by["dev"].c_kv, by["dev"].c_act) == ("device", 0.0, 0.0)
    assert (by["host"].kv_source, by["host"].c_kv) == ("host", pytest.approx(800 * 1e-4))
    assert (by["none"].kv_source, by["none"].c_kv) == ("recompute", pytest.approx(800 * 1e-3))
    assert (by["none"].act, by["none"].c_act, by["none"].fresh_replica) == ("switch", 0.5, False)
    assert (by["cold"].act, by["cold"].c_act, by["cold"].fresh_replica) == ("open", 4.0, True)
    assert (d.instance_id, d.reason) == ("dev", "cost")
    # A new session has no prefix anywhere: the whole prompt is dR_req, C_KV is zero everywhere.
    d2 = decide(PlacementState(req(session="new"), [dev, host], PolicyParams()), now=0.0)
    for c in d2.costs:
        assert (c.kv_source, c.c_kv) == ("none", 0.0)
        assert c.delta_r == pytest.approx(1000 * 1e-3 + 50 * 0.01)


def test_a_prefix_in_the_shared_host_store_is_a_restore_on_every_host_tier_instance():
    """Issue 12: the kvstore is one registry for the cluster, so a prefix one instance reports as checkpointed
    (``KV_HOST``) is a restore on every instance with a host tier, a recompute only where there is none. A
    copy that is only on some device is not in the store (write-back, or the checkpoint still in flight)."""
    writer = inst("w", kv={("s", "m"): (KV_HOST, 800)}, host_kv=True)
    tier, bare = inst("t", host_kv=True), inst("b")
    session = SessionView("m", "w", "w", 800, 0.0)
    st = PlacementState(req(), [writer, tier, bare], PolicyParams(), session=session)
    assert host_prefix(st) == 800
    by = {c.instance_id: c for c in decide(st, now=0.0).costs}
    assert (by["t"].kv_source, by["t"].c_kv) == ("host", pytest.approx(800 * 1e-4))
    assert (by["b"].kv_source, by["b"].c_kv) == ("recompute", pytest.approx(800 * 1e-3))
    for i in (writer, tier, bare):  # the reference path (one instance at a time) agrees with the index
        assert breakdown(i, st) == by[i.instance_id]
    # a session whose last call was another model (two-model sessions): no committed prefix for "m" in the
    # session view, the store's copy still prices the restore
    other = PlacementState(req(), [writer, tier, bare], PolicyParams(), session=SessionView("o", "w", "w", 900, 0.0))
    by = {c.instance_id: c for c in decide(other, now=0.0).costs}
    assert (by["t"].kv_source, by["b"].kv_source) == ("host", "none")
    # only on a device: nothing shared
    dev = inst("w", kv={("s", "m"): (KV_DEVICE, 800)}, host_kv=True)
    st = PlacementState(req(), [dev, tier], PolicyParams(), session=session)
    assert host_prefix(st) == 0
    assert {c.instance_id: c.kv_source for c in decide(st, now=0.0).costs}["t"] == "recompute"


def _decode_curve(points):
    from talaria.cost_curve import CostCurve

    c = CostCurve(0.0)
    c.load(points)
    return c


BATCHED = Profile(prefill_per_token=1e-3, decode_step=0.01, restore_per_token=1e-4, switch_s=0.5, staged_switch_s=0.2,
                  open_s=4.0, decode_by_batch=_decode_curve([(1, 0.01, 4), (8, 0.04, 2)]))


def test_eq1_charges_the_delay_a_call_imposes_on_the_batch_it_joins():
    """Issue 12: dR_req is the work r introduces (§3.3), so it also charges what r's prefill and decode add to
    the calls already running where its model is active: each of the n running (+ forwarded) calls is stalled
    by r's prefill (the recomputed prefix included; with ``imposed_prefill``) and slowed by the learned
    decode-by-batch slope for each of r's decode steps, n x slope = step(n + 1) - step(1). Nothing is imposed on
    an idle instance, nor where r waits for its own slot (model not active), nor with ``charge_imposed`` off."""
    on, off = PolicyParams(imposed_prefill=True), PolicyParams(charge_imposed=False)
    dev = inst("dev", profile=BATCHED, running=4, overlay_calls=1, kv={("s", "m"): (KV_DEVICE, 800)})
    rec = inst("rec", profile=BATCHED, running=2)
    idle = inst("idle", profile=BATCHED)
    sw = inst("sw", profile=BATCHED, running=3, models={"m": ModelRes(loaded=True), "n": ModelRes(loaded=True, active=True)})
    session = SessionView("m", "dev", "dev", 800, 0.0)

    def delta(i, params):
        return breakdown(i, PlacementState(req(), [dev, rec, idle, sw], params, session=session)).delta_r

    step = BATCHED.decode_step_at
    # dev: 5 joined, suffix 200 tokens, prefix on the device
    assert delta(dev, on) - delta(dev, off) == pytest.approx(5 * 200 * 1e-3 + 50 * (step(6) - step(1)))
    # rec: the prefix is recomputed there, which stalls the running calls too
    assert delta(rec, on) - delta(rec, off) == pytest.approx(2 * (200 + 800) * 1e-3 + 50 * (step(3) - step(1)))
    assert delta(idle, on) == delta(idle, off)
    assert delta(sw, on) == delta(sw, off)
    decode_only = PolicyParams()  # the default: the prefill stall not charged, the decode slowdown still
    assert delta(dev, decode_only) - delta(dev, off) == pytest.approx(50 * (step(6) - step(1)))
    assert delta(rec, decode_only) - delta(rec, off) == pytest.approx(50 * (step(3) - step(1)))
    # the index (decide) and the reference (breakdown) agree
    st = PlacementState(req(), [dev, rec, idle, sw], on, session=session)
    for c in decide(st, now=0.0).costs:
        assert c == breakdown({"dev": dev, "rec": rec, "idle": idle, "sw": sw}[c.instance_id], st)


def test_a_return_leaves_its_busy_device_prefix_when_the_batch_it_would_slow_costs_more():
    """The placement the term changes: the session's prefix is on a busy instance's device (6 running), an idle
    instance would recompute it. For r alone the device copy is cheaper (1.0 s vs 1.2 s); counting what its
    decode steps add to the six calls (0.6 s more), the idle instance is."""
    busy = inst("busy", profile=BATCHED, running=6, kv={("s", "m"): (KV_DEVICE, 800)})
    idle = inst("idle", profile=BATCHED)
    session = SessionView("m", "busy", "busy", 800, 0.0)
    prompt = req(session="s", prompt=1000, decode=20.0)
    pick = {ci: decide(PlacementState(prompt, [busy, idle], PolicyParams(running_weight=0.0, charge_imposed=ci),
                                      session=session), now=0.0).instance_id for ci in (False, True)}
    assert pick == {False: "busy", True: "idle"}


def test_completion_newer_than_snapshot_counts_as_device_kv():
    """The snapshot cannot know a call that finished after it was sent: the hook's prefix is trusted."""
    a = inst("a", snapshot_unix=10.0)
    session = SessionView("m", "a", "a", 500, done_unix=11.0)
    c = decide(PlacementState(req(), [a], session=session), now=11.5).costs[0]
    assert (c.kv_source, c.c_kv) == ("device", 0.0)
    old = SessionView("m", "a", "a", 500, done_unix=9.0)  # the snapshot says it is gone
    assert decide(PlacementState(req(), [a], session=old), now=11.5).costs[0].kv_source == "recompute"


def test_staged_model_changes_activation_not_a_second_open_penalty():
    staged = inst("st", models={"m": ModelRes(staged=True)}, pool="cold")
    c = decide(PlacementState(req(), [staged], PolicyParams(replica_penalty_s=0)), now=0).costs[0]
    assert (c.act, c.c_act) == ("switch", 0.2)
    assert c.total == pytest.approx(c.delta_r + c.c_kv + 0.2)


def test_a_model_new_to_a_cold_instances_rotation_is_gated_by_eq2():
    """A call whose model has no call and no session KV on a cold instance adds it to that instance's rotation
    (a "join"): priced as the switch it is, but admitted only when Eq. 2's gain beats the switch plus the
    switch pair it adds to the instance's rounds (``rotation_cost``). With a switch from host at 1.5 s, a new
    session whose model is merely staged on the idle instance goes to the instance already serving that
    model; once that one queues enough, the join pays; with ``rotation_eq2`` off it is a plain switch."""
    slow = Profile(prefill_per_token=1e-3, decode_step=0.01, restore_per_token=1e-4, switch_s=1.5, staged_switch_s=0.01, open_s=4.0)
    serving = lambda waiting: inst("a", models={"m": ModelRes(loaded=True, active=True), "n": ModelRes(loaded=True, in_rotation=False)},
                                   pool="cold", profile=slow, waiting=waiting)
    staged = inst("b", models={"m": ModelRes(loaded=True, staged=True, in_rotation=False), "n": ModelRes(loaded=True, active=True)},
                  pool="cold", profile=slow)
    quiet = decide(PlacementState(req(session="new"), [serving(1), staged], PolicyParams()), now=0)
    by = {c.instance_id: c for c in quiet.costs}
    assert by["b"].act == "join" and by["b"].fresh_replica and by["b"].reject == "eq2"
    assert by["b"].eq2_threshold == pytest.approx(by["b"].c_act + 2 * 1.5)
    assert by["b"].total < by["a"].total  # Eq. 1 alone would have chosen the staged instance
    assert quiet.instance_id == "a" and not quiet.joins_rotation
    plain = decide(PlacementState(req(session="new"), [serving(1), staged], PolicyParams(rotation_eq2=False)), now=0)
    assert plain.instance_id == "b" and plain.switches_model and not plain.joins_rotation
    busy = decide(PlacementState(req(session="new"), [serving(6), staged], PolicyParams()), now=0)
    assert busy.instance_id == "b" and busy.joins_rotation and busy.switches_model and busy.avoidable_join
    # the existing replica's switch and slot wait is queueing a join removes: Eq. 2's W_existing is its Eq. 1 total
    switching = inst("a", models={"m": ModelRes(loaded=True, in_rotation=True, wait_s=2.0), "n": ModelRes(loaded=True, active=True)},
                     pool="cold", profile=slow)
    thrash = decide(PlacementState(req(session="new"), [switching, staged], PolicyParams()), now=0)
    by = {c.instance_id: c for c in thrash.costs}
    assert by["a"].act == "switch" and by["a"].c_act == pytest.approx(1.5 + 2.0)
    assert by["b"].eq2_gain == pytest.approx(by["a"].total - by["b"].delta_r - by["b"].c_kv)
    assert thrash.instance_id == "b" and thrash.joins_rotation
    # nowhere in a rotation: no replica can admit the call, the gain is unbounded, and the decision's record
    # (``/router/decisions``) stays JSON ("inf"; that endpoint answered 500 while one decision held an inf)
    first = decide(PlacementState(req(session="new"), [staged], PolicyParams()), now=0)
    assert first.instance_id == "b" and math.isinf(first.costs[0].eq2_gain)
    assert json.loads(json.dumps(first.as_dict(), allow_nan=False))["costs"][0]["eq2_gain"] == "inf"
    hot = inst("h", models={"m": ModelRes(loaded=True, in_rotation=False)})  # a hot instance has no rotation: a switch
    assert decide(PlacementState(req(), [hot], PolicyParams()), now=0).costs[0].act == "switch"


def test_the_gateway_reads_a_cold_instances_rotation_from_its_heartbeat():
    """``ModelRes.in_rotation`` on a cold instance: the active model, a model with calls queued or running, a model
    with a session's KV on the device; not one whose sessions are only in the host store, nor an idle one."""
    clock = ManualClock(100.0)
    pools = {"c": PoolSpec("cold", ("m", "q", "d", "h", "i"), 16)}
    ls, _ = make_gateway(clock, pools=pools)
    gw = ls.gw
    snap = snapshot("c", 1, clock, pool=pb.POOL_COLD, models=[
        pb.ModelState(model=x, loaded=True, active=x == "m", max_context=4096, num_waiting=1 if x == "q" else 0) for x in ("m", "q", "d", "h", "i")])
    snap.sessions.append(pb.SessionState(session_id="s1", model="d", committed_tokens=64, state=pb.KV_DEVICE))
    snap.sessions.append(pb.SessionState(session_id="s2", model="h", committed_tokens=64, state=pb.KV_HOST))
    assert gw.on_snapshot(snap)
    models = gw.state_for(gw.request("s", "m", 8, 4))[0].instances[0].models
    assert {x: r.in_rotation for x, r in models.items()} == {"m": True, "q": True, "d": True, "h": False, "i": False}
    # a call of "h" ended there (its session's KV went to the host store in the tool gap): in the rotation for
    # Eq. 2's control window after it, as the heartbeats after the hook show, and out of it after the window
    gw.on_hook(pb.CompletionHook(request_id="r", session_id="s2", model="h", instance_id="c", finish_unix=clock.now(),
                                 prefix=cpb.PrefixHandle(model="h", committed_tokens=64)))
    in_rotation = {}
    for seq, later in ((2, 1.0), (3, gw.params.control_window_s + 1.0)):
        clock.advance(later)
        later_snap = pb.InstanceSnapshot()
        later_snap.CopyFrom(snap)
        later_snap.seq, later_snap.sent_unix = seq, clock.now()
        assert gw.on_snapshot(later_snap)
        in_rotation[seq] = gw.state_for(gw.request("s", "m", 8, 4))[0].instances[0].models["h"].in_rotation
    assert in_rotation == {2: True, 3: False}
    # an engine that restarted (new epoch) has lost its device and its rotation with it
    gw.on_hook(pb.CompletionHook(request_id="r2", session_id="s2", model="h", instance_id="c", finish_unix=clock.now(),
                                 prefix=cpb.PrefixHandle(model="h", committed_tokens=64)))
    restarted = pb.InstanceSnapshot()
    restarted.CopyFrom(snap)
    restarted.epoch, restarted.seq, restarted.sent_unix = 2, 1, clock.advance(0.5)
    assert gw.on_snapshot(restarted)
    assert not gw.state_for(gw.request("s", "m", 8, 4))[0].instances[0].models["h"].in_rotation


def test_a_cold_instance_prices_the_wait_for_its_models_slot():
    """Issue 12: two cold instances hold ``m`` loaded, not active; one will give ``m`` its slot in 3 s, the
    other in 0.1 s. The wait is part of the activation term (Eq. 1), so the call goes where its slot comes
    first; it reaches the policy from the engine's heartbeat (``ModelState.slot_wait_s``). The active model
    carries one too: 0 while its slot admits calls, its next slot's wait while the slot drains (a call there
    waits a round: the call goes to the instance whose slot for it is open)."""
    clock = ManualClock(100.0)
    pools = {i: PoolSpec("cold", ("m", "n"), 16) for i in ("late", "soon")}
    ls, store = make_gateway(clock, pools=pools)
    gw = ls.gw
    for iid, wait in (("late", 3.0), ("soon", 0.1)):
        gw.on_snapshot(snapshot(iid, 1, clock, pool=pb.POOL_COLD, models=[
            pb.ModelState(model="n", loaded=True, active=True, max_context=4096, slot_wait_s=7.0 if iid == "late" else 0.0),
            pb.ModelState(model="m", loaded=True, active=False, max_context=4096, slot_wait_s=wait)]))
    d = place(ls, store, "s1")
    by = {c.instance_id: c for c in d.costs}
    assert d.instance_id == "soon", d.costs
    assert by["late"].c_act - by["soon"].c_act == pytest.approx(2.9)
    assert {i.instance_id: i.models["n"].wait_s for i in gw.instance_states()} == {"late": 7.0, "soon": 0.0}
    dn = gw.decide(gw.request("s3", "n", 800, 64))[0]
    byn = {c.instance_id: c for c in dn.costs}
    assert dn.instance_id == "soon" and {c.act for c in dn.costs} == {"active"}
    assert byn["late"].c_act == pytest.approx(7.0) and byn["soon"].c_act == 0.0
    from dataclasses import replace as _replace

    gw.params = _replace(gw.params, slot_wait=False)  # the ablation (bench matrix "no-slot-wait"): bare switch costs
    d2 = gw.decide(gw.request("s2", "m", 800, 64))[0]
    assert {c.instance_id: c.c_act for c in d2.costs}["late"] == pytest.approx({c.instance_id: c.c_act for c in d2.costs}["soon"])


# --------------------------------------------------------------------------- pure policy: leases


def test_lease_hit_routes_to_reserved_instance_even_if_busier():
    """Algorithm 1 as published (``lease_arithmetic`` off): a valid lease is honoured whatever the queue."""
    a = inst("a", waiting=5, overlay_leases=1, snapshot_unix=0.0)
    b = inst("b")
    lease = LeaseView("L1", "a", "m", 800, t_done_unix=1.0, t_exp_unix=2.0)
    d = decide(PlacementState(req(), [a, b], PolicyParams(lease_arithmetic=False), lease=lease), now=1.5)
    assert (d.instance_id, d.reason, d.lease) == ("a", "lease", "hit")
    # The call's own lease is not queue ahead of it.
    assert d.costs[0].queue_s == pytest.approx((1e-3 * 256 + 0.01 * 64) * 5)
    # With the lease arithmetic (the default, issue 12 item 3) the same lease delays the call by ~4.5 s of
    # queue to save recomputing 800 tokens (0.8 s) on the idle instance: it is not honoured.
    d = decide(PlacementState(req(), [a, b], lease=lease), now=1.5)
    assert (d.instance_id, d.reason, d.lease) == ("b", "cost", "outweighed")


def test_expired_lease_falls_back_to_cost_placement():
    a = inst("a", waiting=5)
    b = inst("b")
    lease = LeaseView("L1", "a", "m", 800, t_done_unix=1.0, t_exp_unix=2.0)
    d = decide(PlacementState(req(), [a, b], lease=lease), now=2.0)
    assert (d.lease, d.reason, d.instance_id) == ("expired", "cost", "b")


def test_lease_to_unhealthy_instance_is_not_honoured_and_instance_skipped():
    a = inst("a", healthy=False)
    b = inst("b", waiting=3)
    lease = LeaseView("L1", "a", "m", 800, t_done_unix=1.0, t_exp_unix=2.0)
    d = decide(PlacementState(req(), [a, b], lease=lease), now=1.2)
    assert (d.lease, d.instance_id) == ("unhealthy", "b")
    assert {c.instance_id: c.reject for c in d.costs}["a"] == "unhealthy"


def test_lease_needs_a_valid_prefix_and_same_epoch():
    a = inst("a", snapshot_unix=5.0, epoch=2)  # snapshot newer than the lease and no session listed
    lease = LeaseView("L1", "a", "m", 800, t_done_unix=1.0, t_exp_unix=9.0)
    assert decide(PlacementState(req(), [a], lease=lease), now=6).lease == "prefix-invalid"
    a2 = inst("a", snapshot_unix=5.0, epoch=2, kv={("s", "m"): (KV_HOST, 800)})
    assert decide(PlacementState(req(), [a2], lease=lease), now=6).lease == "hit"  # host-restorable is valid
    restarted = LeaseView("L1", "a", "m", 800, t_done_unix=1.0, t_exp_unix=9.0, epoch=1)
    assert decide(PlacementState(req(), [a2], lease=restarted), now=6).lease == "prefix-invalid"


def test_stale_snapshot_excluded_from_new_calls_but_lease_honoured():
    a = inst("a", fresh=False, snapshot_unix=0.0)
    b = inst("b", waiting=4)
    assert decide(PlacementState(req(session="new"), [a, b]), now=1).instance_id == "b"
    lease = LeaseView("L1", "a", "m", 800, t_done_unix=1.0, t_exp_unix=2.0)
    assert decide(PlacementState(req(), [a, b], lease=lease), now=1.5).instance_id == "a"


def test_a_lease_that_would_open_a_replica_passes_eq2_first():
    """Issue 48: Eq. 2 gates every open (§3.3), a lease's too. The leased cold instance switched away from the
    model during the tool gap (not resident there now, the prefix only host-restorable) while another instance
    has it active: honouring the lease opened a replica Eq. 2 rejects -- an avoidable open (§5.3's count) that
    Algorithm 1's lease check (live, healthy, prefix valid) let through. The lease is dropped ("eq2") and the
    call placed by cost; with no resident replica anywhere the gain is unbounded and the lease is honoured."""
    leased = inst("a", models={"m": ModelRes()}, pool="cold", kv={("s", "m"): (KV_HOST, 800)}, snapshot_unix=5.0)
    resident = inst("b", waiting=1)
    lease = LeaseView("L1", "a", "m", 800, t_done_unix=1.0, t_exp_unix=9.0)
    for p in (PolicyParams(lease_arithmetic=False), PolicyParams()):
        d = decide(PlacementState(req(), [leased, resident], p, lease=lease), now=6.0)
        assert (d.instance_id, d.lease, d.reason) == ("b", "eq2", "cost")
        assert not d.opens_model and not d.avoidable_open
        assert {c.instance_id: c.reject for c in d.costs}["a"] == "eq2"
    d = decide(PlacementState(req(), [leased, inst("c", models={"m": ModelRes()}, pool="cold")], lease=lease), now=6.0)
    assert (d.instance_id, d.lease, d.reason) == ("a", "hit", "lease") and d.opens_model and not d.avoidable_open
    # A lease whose instance still has the model resident is not gated by Eq. 2 (no open).
    still = inst("a", models={"m": ModelRes(loaded=True, active=True)}, kv={("s", "m"): (KV_DEVICE, 800)}, snapshot_unix=5.0)
    d = decide(PlacementState(req(), [still, resident], PolicyParams(lease_arithmetic=False), lease=lease), now=6.0)
    assert (d.instance_id, d.lease) == ("a", "hit")


# ------------------------------------------------------------------------- pure policy: Eq. 2, overload


def test_eq2_gate_blocks_a_fresh_replica_unless_the_gain_pays_for_it():
    hot = inst("y", waiting=2)
    cold = inst("x", models={"m": ModelRes()}, pool="cold")
    p = PolicyParams(replica_penalty_s=1.0, hbm_price_s_per_gib=0.1)
    d = decide(PlacementState(req(session="new"), [hot, cold], p, demand={"m": 1.0}), now=0)
    x = {c.instance_id: c for c in d.costs}["x"]
    assert d.instance_id == "y"
    assert x.reject == "eq2" and x.eq2_gain < x.eq2_threshold
    assert x.eq2_threshold == pytest.approx(4.0 + 0.1 * 1.0 + 1.0)
    # Heavy predicted demand behind a long queue: the replica's gain exceeds switch + HBM + penalty.
    busy = inst("y", waiting=40)
    d2 = decide(PlacementState(req(session="new"), [busy, cold], p, demand={"m": 20.0}), now=0)
    x2 = {c.instance_id: c for c in d2.costs}["x"]
    assert x2.reject == "" and x2.eq2_gain > x2.eq2_threshold
    assert d2.instance_id == "x" and d2.opens_model and not d2.avoidable_open is False  # y has it resident
    assert d2.avoidable_open
    # No replica anywhere: the gain is unbounded, the model must be opened.
    d3 = decide(PlacementState(req(session="new"), [cold], p), now=0)
    assert d3.instance_id == "x" and math.isinf(d3.costs[0].eq2_gain) and not d3.avoidable_open


def test_memory_pressure_raises_the_hbm_price():
    cold_free = inst("x", models={"m": ModelRes()}, pool="cold", kv_usage=0.0)
    cold_full = inst("z", models={"m": ModelRes()}, pool="cold", kv_usage=0.9)
    hot = inst("y", waiting=10)
    p = PolicyParams(hbm_price_s_per_gib=1.0, replica_penalty_s=0.0, model_weights_gib={"m": 10.0})
    d = decide(PlacementState(req(session="new"), [hot, cold_free, cold_full], p, demand={"m": 3}), now=0)
    by = {c.instance_id: c for c in d.costs}
    assert by["z"].eq2_threshold - by["x"].eq2_threshold == pytest.approx(10.0 * (1 / 0.1 - 1.0))


def test_overload_when_no_candidate_passes_round_admission():
    a = inst("a", waiting=100)
    b = inst("b", waiting=120)
    p = PolicyParams(admission_budget_s=5.0, retry_after_s=1.0)
    d = decide(PlacementState(req(session="new"), [a, b], p), now=0)
    assert (d.instance_id, d.reason) == (None, "overload")
    assert {c.reject for c in d.costs} == {"round-admission"}
    assert d.retry_after_s >= 1.0
    # Unhealthy-only is not overload: nothing can serve.
    d2 = decide(PlacementState(req(session="new"), [inst("a", healthy=False)], p), now=0)
    assert d2.reason == "no-instance"


def test_memory_check_rejects_a_call_that_cannot_fit():
    small = inst("a", kv_pages_total=10, page_size=16)
    big = inst("b", kv_pages_total=1000, page_size=16, waiting=3)
    d = decide(PlacementState(req(session="new", prompt=400, max_tokens=100), [small, big]), now=0)
    assert d.instance_id == "b"
    assert {c.instance_id: c.reject for c in d.costs}["a"] == "memory"


def test_overlay_of_forwarded_calls_and_leases_moves_placement():
    a, b = inst("a"), inst("b")
    assert decide(PlacementState(req(session="new"), [a, b]), now=0).instance_id == "a"
    a2 = inst("a", overlay_calls=1)
    assert decide(PlacementState(req(session="new"), [a2, b]), now=0).instance_id == "b"
    a3 = inst("a", overlay_leases=1)  # a lease reserved for another session charges one admission unit
    assert decide(PlacementState(req(session="new"), [a3, b]), now=0).instance_id == "b"
    zero = PolicyParams(admission_unit=0.0)
    assert decide(PlacementState(req(session="new"), [a3, b], zero), now=0).instance_id == "a"


# ------------------------------------------------------------------------------------- baselines


def test_baselines_least_pressure_sticky_round_robin():
    cold_a = inst("a", models={"m": ModelRes()}, pool="cold")  # empty: would have to open
    b = inst("b", waiting=2)
    lp = decide(PlacementState(req(session="new"), [cold_a, b], PolicyParams(policy="least-pressure")), now=0)
    assert lp.instance_id == "a" and lp.opens_model and lp.avoidable_open
    full = decide(PlacementState(req(session="new"), [cold_a, b], PolicyParams()), now=0)
    assert full.instance_id == "b" and not full.avoidable_open
    s = SessionView("m", last_instance="a", first_instance="b", committed_tokens=100, done_unix=0)
    st = decide(PlacementState(req(), [inst("a"), inst("b", waiting=9)], PolicyParams(policy="session-sticky"), session=s), now=0)
    assert (st.instance_id, st.reason) == ("b", "sticky")
    rr = [decide(PlacementState(req(), [inst("a"), inst("b")], PolicyParams(policy="round-robin"), seq=k), now=0).instance_id for k in range(4)]
    assert rr == ["a", "b", "a", "b"]
    with pytest.raises(ValueError):
        decide(PlacementState(req(), [b], PolicyParams(policy="nope")), now=0)


# ----------------------------------------------------------------------------- gateway + manual clock


def snapshot(iid, seq, clock, waiting=0, epoch=1, sessions=(), period=0.5, pool=pb.POOL_HOT, models=None, running=0):
    snap = pb.InstanceSnapshot(
        instance_id=iid, epoch=epoch, seq=seq, heartbeat_period_s=period, num_waiting=waiting, sent_unix=clock.now(), pool=pool,
        num_running=running,
    )
    for m in models or [pb.ModelState(model="m", loaded=True, active=True, max_context=4096)]:
        snap.models.append(m)
    for sid, tokens in sessions:
        snap.sessions.append(pb.SessionState(session_id=sid, model="m", committed_tokens=tokens, state=pb.KV_DEVICE))
    snap.profile.CopyFrom(pb.CostProfile(prefill_per_token=1e-3, decode_step=0.01))
    return snap


def hook(iid, session, clock, tokens=600, rid="r1"):
    return pb.CompletionHook(
        request_id=rid, session_id=session, model="m", instance_id=iid, finish_unix=clock.now(),
        prefix=cpb.PrefixHandle(model="m", committed_tokens=tokens),
        usage=cpb.Usage(prompt_tokens=tokens, cached_tokens=max(0, tokens - 100), completion_tokens=20),
    )


def make_gateway(clock, tau=1.0, policy="full", pools=None):
    reg = Registry(clock, miss_limit=3, stale_after=2, wall=clock.now)
    table = LeaseTable()
    gw = Gateway(PolicyParams(policy=policy), reg, SessionTable(clock), table, clock.now, tau_s=tau, pools=pools, shapes=ShapeBook())
    store = MemoryLeases(table)
    return LeaseService(gw, store), store


def place(ls, store, session, prompt=800, rid=""):
    """What admission does: decide, settle the judged lease (a hit consumed, another discarded), commit (with
    the call's id)."""
    gw = ls.gw
    r = gw.request(session, "m", prompt, 64)
    d, rev = gw.decide(r)
    assert ls.settle_now(d, rev, session, "m").stands
    if d.instance_id is not None:
        ls.commit(r, d, rid)
    return d


def test_gateway_reads_the_host_tier_flag_from_the_heartbeat():
    """An engine's heartbeat says whether it has a host KV tier (``InstanceSnapshot.host_kv``): the router
    then prices a prefix another instance checkpointed as a restore there."""
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock)
    gw = ls.gw
    a = snapshot("a", 1, clock)
    a.sessions.append(pb.SessionState(session_id="s1", model="m", committed_tokens=700, state=pb.KV_HOST))
    a.host_kv = True
    b = snapshot("b", 1, clock)
    b.host_kv = True
    c = snapshot("c", 1, clock)
    for snap in (a, b, c):
        gw.on_snapshot(snap)
    assert {st.instance_id: st.host_kv for st in gw.instance_states()} == {"a": True, "b": True, "c": False}
    d, _ = gw.decide(gw.request("s1", "m", 800, 64))
    assert {x.instance_id: x.kv_source for x in d.costs} == {"a": "host", "b": "host", "c": "none"}


def test_gateway_lease_consumed_on_return_then_successor_installed():
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock, waiting=3))
    gw.on_snapshot(snapshot("b", 1, clock))
    assert place(ls, store, "s").instance_id == "b"
    clock.advance(0.3)
    lease = ls.on_hook(hook("b", "s", clock))
    store.install_now(lease)
    assert lease.t_exp_unix == pytest.approx(101.3) and len(gw.leases) == 1
    # Another session sees b charged by the lease (and the first call's overlay).
    gw.on_snapshot(snapshot("a", 2, clock, waiting=0))
    assert place(ls, store, "other").instance_id == "a"
    clock.advance(0.4)  # tool gap shorter than tau
    d = place(ls, store, "s", prompt=900)
    assert (d.instance_id, d.reason, d.lease) == ("b", "lease", "hit")
    assert len(gw.leases) == 0  # consumed; no refresh until the next completion
    m = gw.metrics()
    assert (m["lease_hits"], m["returns"], m["same_instance_returns"]) == (1, 1, 1)
    store.install_now(ls.on_hook(hook("b", "s", clock, tokens=950, rid="r2")))
    assert gw.leases.get("s", "m")[0].lease_id == "r2"


def test_gateway_expired_lease_is_counted_and_placement_uses_kv_cost():
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock))
    gw.on_snapshot(snapshot("b", 1, clock))
    store.install_now(ls.on_hook(hook("b", "s", clock, tokens=2000)))
    clock.advance(0.4)
    gw.on_snapshot(snapshot("a", 2, clock))
    gw.on_snapshot(snapshot("b", 2, clock, waiting=1, sessions=[("s", 2000)]))
    clock.advance(1.0)  # past tau; heartbeats still fresh enough (< 2 periods)
    gw.on_snapshot(snapshot("a", 3, clock))
    gw.on_snapshot(snapshot("b", 3, clock, waiting=1, sessions=[("s", 2000)]))
    d = place(ls, store, "s", prompt=2100)
    assert (d.lease, d.reason, d.instance_id) == ("expired", "cost", "b")  # device KV outweighs one queued call
    assert gw.metrics()["lease_expiries"] == 1


def test_gateway_missed_heartbeats_exclude_instance_and_void_its_lease():
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock, tau=5.0)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock))
    gw.on_snapshot(snapshot("b", 1, clock))
    store.install_now(ls.on_hook(hook("a", "s", clock)))
    clock.advance(1.6)  # a silent for > 3 periods of 0.5 s
    gw.on_snapshot(snapshot("b", 2, clock))
    d = place(ls, store, "s")
    assert (d.lease, d.instance_id) == ("unhealthy", "b")
    m = gw.metrics()
    assert (m["lease_misses"], m["counters"]["lease_miss_unhealthy"], m["moved_returns"]) == (1, 1, 1)


def test_gateway_stale_snapshot_between_stale_and_miss_limits():
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock, tau=5.0)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock))
    gw.on_snapshot(snapshot("b", 1, clock, waiting=5))
    store.install_now(ls.on_hook(hook("a", "s", clock)))
    clock.advance(1.2)  # a: 2.4 periods old -> stale but still healthy
    gw.on_snapshot(snapshot("b", 2, clock, waiting=5))
    assert place(ls, store, "new").instance_id == "b"
    assert place(ls, store, "s").instance_id == "a"  # the live lease is honoured


def test_gateway_overlay_cleared_only_by_a_snapshot_sent_after_the_forward():
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock, tau=0)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock))
    early = snapshot("a", 2, clock)  # taken before the forward, delivered after it
    clock.advance(0.01)
    assert place(ls, store, "x").instance_id == "a"
    assert gw.registry.instances["a"].inflight == 1
    gw.on_snapshot(early)
    assert gw.registry.instances["a"].inflight == 1
    clock.advance(0.01)
    gw.on_snapshot(snapshot("a", 3, clock, waiting=1))
    assert gw.registry.instances["a"].inflight == 0


def test_a_finished_call_is_not_queue_ahead_of_anyone():
    """Issue 12: the completion hook takes the call out of the router's view of the instance's load, both
    when no snapshot counted it yet (overlay) and when the last snapshot, sent before it finished, still
    counts it as running; a snapshot sent after the finish is the truth again."""
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock, tau=0)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock))
    clock.advance(0.01)
    assert place(ls, store, "s", rid="c1").instance_id == "a"
    v = gw.registry.instances["a"]
    assert v.inflight == 1
    clock.advance(0.05)
    ls.on_hook(hook("a", "s", clock, rid="c1"))  # finished before any snapshot counted it
    assert (v.inflight, v.running) == (0, 0)
    st = gw.instance_states()[0]
    assert (st.overlay_calls, st.running) == (0, 0)
    # counted as running by a snapshot sent before it finished
    assert place(ls, store, "t", rid="c2").instance_id == "a"
    clock.advance(0.01)
    gw.on_snapshot(snapshot("a", 2, clock, running=1))
    assert (v.inflight, v.running) == (0, 1)
    clock.advance(0.05)
    ls.on_hook(hook("a", "t", clock, rid="c2"))
    assert v.running == 0
    assert gw.instance_states()[0].running == 0
    assert ls.lease_costs("a", "m", 600).harm_per_s == 0.0  # a lone idle instance: a lease there delays nobody
    # a snapshot sent after the finish replaces the correction; one sent before it does not
    clock.advance(0.01)
    gw.on_snapshot(snapshot("a", 3, clock, running=2))
    assert v.running == 2


def test_a_zero_gap_return_stays_with_its_kv_before_the_hook_arrives():
    """The finished chunk reaches the client before the engine's completion hook reaches the router. A
    session whose next call comes at once must still see its instance free and its KV there (it moved to an
    idle twin, losing the prefix: the flaky ``test_prefix_hit_gives_same_tokens_as_cold_run``); the late
    hook then changes nothing, whether or not a snapshot came in between."""
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock, tau=0)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock))
    gw.on_snapshot(snapshot("b", 1, clock))
    clock.advance(0.01)
    assert place(ls, store, "s", rid="c1").instance_id == "a"
    clock.advance(0.01)
    gw.on_snapshot(snapshot("a", 2, clock, running=1))  # sent while c1 ran
    gw.on_snapshot(snapshot("b", 2, clock))
    clock.advance(0.05)
    gw.call_ended("c1", "a", "s", "m", 620)  # the router saw c1's finished chunk; no hook yet
    v = gw.registry.instances["a"]
    assert (v.inflight, v.running) == (0, 0)
    assert place(ls, store, "s", rid="c2").instance_id == "a"  # the return, before c1's hook
    ls.on_hook(hook("a", "s", clock, tokens=608, rid="c1"))  # late: c1 is not ended twice
    assert (v.inflight, v.running) == (1, 0)
    # c2 ends from the overlay; a snapshot sent between its forward and its end counts it as running
    clock.advance(0.01)
    fwd_snap = snapshot("a", 3, clock, running=1)
    clock.advance(0.01)
    gw.call_ended("c2", "a", "s", "m", 700)
    assert (v.inflight, v.running) == (0, 0)
    gw.on_snapshot(fwd_snap)  # delivered after the end: it still counts c2, which has ended
    assert (v.inflight, v.running) == (0, 0)
    ls.on_hook(hook("a", "s", clock, tokens=688, rid="c2"))
    assert (v.inflight, v.running) == (0, 0)
    clock.advance(0.01)
    gw.on_snapshot(snapshot("a", 4, clock))
    assert (v.inflight, v.running, v.done, v.ended) == (0, 0, {}, {})
    # another session's call runs (counted by the snapshot); c3 is forwarded and ends before any snapshot:
    # its late hook must not take the running call off the instance's load
    gw.on_snapshot(snapshot("a", 5, clock, running=1))
    gw.on_snapshot(snapshot("b", 3, clock, waiting=5))  # busier: c3 goes to a
    clock.advance(0.01)
    assert place(ls, store, "t", rid="c3").instance_id == "a"
    clock.advance(0.01)
    gw.call_ended("c3", "a", "t", "m", 700)
    assert (v.inflight, v.running) == (0, 1)
    ls.on_hook(hook("a", "t", clock, tokens=688, rid="c3"))
    assert (v.inflight, v.running) == (0, 1)


def test_gateway_engine_restart_drops_sessions_and_leases():
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock))
    store.install_now(ls.on_hook(hook("a", "s", clock)))
    gw.on_snapshot(snapshot("a", 1, clock, epoch=2))
    assert len(gw.leases) == 0 and gw.sessions.get("s") is None


def test_gateway_cold_catalog_from_config_and_avoidable_open_accounting():
    clock = ManualClock(100.0)
    pools = {"c1": PoolSpec("cold", ("m", "n")), "c2": PoolSpec("cold", ("m", "n"))}
    ls, store = make_gateway(clock, policy="least-pressure", pools=pools)
    gw = ls.gw
    gw.on_snapshot(snapshot("c1", 1, clock, waiting=1, pool=pb.POOL_COLD))
    gw.on_snapshot(snapshot("c2", 1, clock, pool=pb.POOL_COLD, models=[pb.ModelState(model="n", loaded=True, active=True)]))
    d = place(ls, store, "new")
    assert d.instance_id == "c2" and d.opens_model and d.avoidable_open
    assert gw.metrics()["avoidable_cold_opens"] == 1 and gw.known_model("n")


# ------------------------------------------------------------------------ app: overload policy


class _FakeNC:
    is_connected = True


def _app(policy_overrides: dict):
    from services.router.app import create_app
    from services.router.service import make_state
    from talaria.config import parse_config

    cfg = parse_config({"router": {"placement": {"admission_budget_s": 1.0, **policy_overrides}}, "engines": [{"id": "e0", "models": ["m"]}]})
    state = make_state(cfg)
    state.nc = _FakeNC()
    snap = pb.InstanceSnapshot(instance_id="e0", epoch=1, seq=1, heartbeat_period_s=30, num_waiting=500)
    snap.models.append(pb.ModelState(model="m", loaded=True, active=True, max_context=4096))
    state.gateway.on_snapshot(snap)
    return state, TestClient(create_app(state))


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_overload_reject_answers_429_with_retry_after():
    state, client = _app({"overload": "reject"})
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
    assert int(r.headers["retry-after"]) >= 1
    assert client.get("/router/metrics").json()["placement"]["overload_rejected"] == 1
    assert client.get("/router/decisions").json()["decisions"][-1]["reason"] == "overload"


def test_overload_queue_is_bounded_in_size_and_time():
    state, client = _app({"overload": "queue", "queue_timeout_s": 0.2, "queue_max": 1})
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 429 and r.headers["retry-after"]
    m = client.get("/router/metrics").json()["placement"]
    assert (m["overload_queued"], m["overload_queue_timeouts"], m["gateway_queued"]) == (1, 1, 0)
    state.gateway.queued = 1  # the queue is full: answered at once
    r2 = client.post("/v1/chat/completions", json=BODY)
    assert r2.status_code == 429 and "full" in r2.json()["error"]["message"]


def test_an_unmeasured_replica_borrows_its_peers_costs_not_the_priors():
    """Issue 12 #2: a replica that has measured nothing yet is priced like its measured twin (same pool, device,
    models), not at the config priors; its own measurement wins once it has one; another group keeps the priors."""
    from services.router.profiles import Defaults

    clock = ManualClock(100.0)
    ls, store = make_gateway(clock, tau=5.0)
    gw = ls.gw
    cheap = pb.CostProfile(prefill_per_token=1e-5, decode_step=1e-3)  # far below the priors (2e-4, 0.02)
    a = snapshot("a", 1, clock)
    a.profile.CopyFrom(cheap)
    b = snapshot("b", 1, clock)
    b.ClearField("profile")  # a fresh replica: nothing measured
    other = snapshot("c", 1, clock, models=[pb.ModelState(model="x", loaded=True, active=True, max_context=4096)])
    other.ClearField("profile")
    for s in (a, b, other):
        gw.on_snapshot(s)
    pb_, pc = gw.profiles.profile("b"), gw.profiles.profile("c")
    assert (pb_.prefill_per_token, pb_.decode_step) == (1e-5, 1e-3)
    assert (pc.prefill_per_token, pc.decode_step) == (Defaults().prefill_per_token, Defaults().decode_step)
    # a new session lands on a, which then holds its lease: the next new session goes to the twin without one
    assert place(ls, store, "s1").instance_id == "a"
    lease = ls.on_hook(hook("a", "s1", clock, tokens=200))
    store.install_now(lease)
    gw.on_snapshot(_with_profile(snapshot("a", 2, clock), cheap))
    gw.on_snapshot(_with_profile(snapshot("b", 2, clock), None))
    d = place(ls, store, "s2")
    assert d.instance_id == "b", d.costs
    # b's own measurement replaces the borrowed one
    gw.on_snapshot(_with_profile(snapshot("b", 3, clock), pb.CostProfile(prefill_per_token=3e-5, decode_step=2e-3)))
    assert gw.profiles.profile("b").prefill_per_token == pytest.approx(3e-5)
    # a replica that changes groups (now serves "x" only) lends and borrows in its new group only
    gw.on_snapshot(_with_profile(snapshot("a", 3, clock, models=[pb.ModelState(model="x", loaded=True, active=True, max_context=4096)]), cheap))
    assert gw.profiles.profile("c").prefill_per_token == pytest.approx(1e-5)  # a's costs, now its peer
    gw.profiles.forget("a")
    assert gw.profiles.profile("c").prefill_per_token == Defaults().prefill_per_token  # a forgotten: priors again


def _with_profile(snap, profile):
    snap.ClearField("profile")
    if profile is not None:
        snap.profile.CopyFrom(profile)
    return snap
