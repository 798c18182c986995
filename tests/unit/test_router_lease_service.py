"""The router's ``LeaseService`` driven directly, under a manual clock, with a real gateway and a real
in-memory lease store: a call's admission settles its lease through the service (consumed in the store, its
id and engine epoch on the forward step, the replay guard armed), a lease lost to another replica is placed
again without it, a finished call records its KV and carries a resume token whose lease a replica that never
saw it installs and consumes, and a hook's lease the arithmetic declines is never installed. No NATS."""

from __future__ import annotations

import asyncio
from collections import Counter

from services.router.gateway import Gateway, OverloadPolicy
from services.router.lease_service import RACED, LeaseService
from services.router.leases import LeaseTable, MemoryLeases
from services.router.policy import CallRequest, PolicyParams
from services.router.profiles import ShapeBook
from services.router.registry import Registry
from services.router.resume import Resumes, ResumeSigner
from services.router.sessions import SessionTable
from talaria.clock import ManualClock
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from tests.unit.test_router_placement import hook, snapshot

SECRET = b"resume-secret-shared-by-replicas"


def service(clock: ManualClock, policy: str = "fixed", tau: float = 2.0) -> LeaseService:
    reg = Registry(clock, miss_limit=3, stale_after=2, wall=clock.now)
    table = LeaseTable()
    gw = Gateway(PolicyParams(lease_policy=policy), reg, SessionTable(clock), table, clock.now, tau_s=tau, shapes=ShapeBook())
    return LeaseService(gw, MemoryLeases(table), Resumes(ResumeSigner(SECRET, clock.now), Counter()))


def wire(session: str = "s", rid: str = "q1") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, session_id=session, model="m", sampling=pb.SamplingParams(max_tokens=16))


def test_admission_settles_a_honoured_lease_through_the_service():
    """A return whose lease the policy honours: the admission step consumes it in the store (the table no
    longer holds it), carries its id and epoch to the forward, counts the hit, and the commit records the call
    as a return placed on its lease (what its hook teaches the residency book)."""
    clock = ManualClock(100.0)
    ls = service(clock)
    gw, store = ls.gw, ls.store
    gw.on_snapshot(snapshot("a", 1, clock, epoch=4))
    gw.on_snapshot(snapshot("b", 1, clock, waiting=3))
    adm = ls.admit(wire(rid="q1"), 800, OverloadPolicy())
    step = asyncio.run(adm.step())
    assert (step.kind, step.decision.instance_id, step.lease_id) == ("forward", "a", "")
    adm.commit(step.decision, "q1")
    clock.advance(0.5)
    lease = ls.on_hook(hook("a", "s", clock, rid="q1"))
    store.install_now(lease)
    assert lease.instance_epoch == 4 and lease.t_exp_unix - lease.t_done_unix == 2.0
    clock.advance(0.5)
    adm = ls.admit(wire(rid="q2"), 900, OverloadPolicy())
    step = asyncio.run(adm.step())
    assert (step.decision.lease, step.decision.instance_id) == ("hit", "a")
    assert (step.lease_id, step.lease_epoch) == ("q1", 4)  # the engine fences the call on this epoch
    assert gw.leases.get("s", "m") is None and gw.stats["lease_hits"] == 1  # consumed in the store
    adm.commit(step.decision, "q2")
    assert ls._returning[("s", "m")] is True


def test_a_lease_lost_to_another_replica_is_placed_again_without_it():
    """The store's lease changed after the decision judged it (a peer replica consumed it and a newer call
    installed another): consuming at the judged revision fails, the step does not stand, the admission
    decides again without a lease and spends no attempt on it."""
    clock = ManualClock(100.0)
    ls = service(clock)
    gw, store = ls.gw, ls.store
    gw.on_snapshot(snapshot("a", 1, clock))
    gw.on_snapshot(snapshot("b", 1, clock))
    gw.sessions.record("s", "m", "a", 600, done_unix=clock.now())
    lease = ls.on_hook(hook("a", "s", clock, rid="q1"))
    store.install_now(lease)
    d, judged = gw.decide(gw.request("s", "m", 900, 16))
    assert d.lease == "hit"
    peer = type(lease)()
    peer.CopyFrom(lease)
    peer.lease_id = "peer"
    store.install_now(peer)  # a newer revision of the same key
    assert ls.settle_now(d, judged, "s", "m") == RACED
    assert gw.stats["lease_miss_raced"] == 1 and gw.stats["lease_hits"] == 0
    assert gw.leases.get("s", "m")[0].lease_id == "peer"  # the peer's lease stays
    # the same through admission: the race is absorbed, the call is placed without a lease
    adm = ls.admit(wire(rid="q2"), 900, OverloadPolicy(max_attempts=1))
    real = store.consume_now
    store.consume_now = lambda *a: False  # every consume loses to another replica
    step = asyncio.run(adm.step())
    store.consume_now = real
    assert (step.kind, step.decision.lease, step.lease_id) == ("forward", "none", "")
    assert gw.stats["lease_miss_raced"] == 2 and adm.attempts == 1


def test_a_finished_call_carries_a_resume_token_another_replica_installs_once():
    """The finished chunk records the session's KV where it ran (before any hook) and issues the token; a
    replica that never saw the lease installs it at revision 0 when the token comes back, its admission
    consumes it locally, and the same token is not honoured again there."""
    clock = ManualClock(100.0)
    issuer, other = service(clock), service(clock)
    for ls in (issuer, other):
        ls.gw.on_snapshot(snapshot("a", 1, clock, epoch=7))
        ls.gw.on_snapshot(snapshot("b", 1, clock))
    token = issuer.finished(wire(rid="q1"), "a", cpb.Usage(prompt_tokens=30, completion_tokens=11))
    entry = issuer.gw.sessions.get("s")
    assert token and (entry.instance_id, entry.committed_tokens) == ("a", 41)
    assert issuer.resumes.counters["resume_token_issued"] == 1
    clock.advance(0.2)
    other.gw.on_snapshot(snapshot("b", 2, clock, waiting=2))  # b busier: without the lease a return could go either way
    adm = other.admit(wire(rid="q2"), 50, OverloadPolicy(), resume_token=token)
    assert other.gw.leases.get("s", "m")[1] == 0  # installed locally, revision 0
    step = asyncio.run(adm.step())
    assert (step.decision.lease, step.decision.instance_id, step.lease_id, step.lease_epoch) == ("hit", "a", "q1", 7)
    assert other.gw.leases.get("s", "m") is None  # consumed here only
    again = other.admit(wire(rid="q3"), 50, OverloadPolicy(), resume_token=token)
    assert other.resumes.counters["resume_token_replayed"] == 1 and other.gw.leases.get("s", "m") is None
    again.close()


def test_a_lease_the_arithmetic_declines_is_never_installed():
    """Adaptive leases on a busy router: a small prefix after an uncertain gap saves less than holding the
    reservation costs every other arrival, so the hook installs nothing and the decline is counted."""
    clock = ManualClock(100.0)
    ls = service(clock, policy="adaptive", tau=1.0)
    gw = ls.gw
    gw.on_snapshot(snapshot("a", 1, clock, waiting=4))
    for _ in range(200):  # 20 calls/s of other traffic
        ls.arrival(CallRequest("", "m", 100, 10, 10.0))
        clock.advance(0.05)
    assert ls.on_hook(hook("a", "s", clock, tokens=20)) is None
    assert gw.stats["leases_declined"] == 1 and gw.stats["leases_installed"] == 0 and len(gw.leases) == 0
    assert ls.metrics()["lease_sizing"]["m|"]["installed"] == 0
