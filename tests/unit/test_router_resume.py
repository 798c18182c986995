"""Issue 17, signed resume tokens: HMAC verification (forged / tampered / expired / other tenant, session or
model / replayed are ignored and counted), and a token honoured by a router replica that never saw the lease
(two real gateways with private lease stores = a partitioned shared store)."""

from __future__ import annotations

from collections import Counter

import pytest

from services.router.gateway import Gateway
from services.router.lease_service import LeaseService
from services.router.leases import LeaseTable
from services.router.policy import PolicyParams
from services.router.registry import Registry
from services.router.resume import ResumeClaim, Resumes, ResumeSigner
from services.router.sessions import SessionTable
from talaria.clock import ManualClock
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb

SECRET = b"resume-secret-shared-by-replicas"


class Wall:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def claim(**kw) -> ResumeClaim:
    d = dict(tenant="team-a", session_id="team-a|S", model="m", instance_id="e0", epoch=7, lease_id="req-1",
             committed_tokens=40, t_done_unix=1000.0, t_exp_unix=1010.0)
    return ResumeClaim(**{**d, **kw})


def test_valid_token_verifies_and_every_alteration_is_refused():
    wall = Wall()
    s = ResumeSigner(SECRET, wall)
    tok = s.issue(claim())
    c, why = s.verify(tok, "team-a", "team-a|S", "m")
    assert (why, c) == ("ok", claim())
    payload, mac = tok.split(".")
    flipped = payload[:-2] + ("A" if payload[-2] != "A" else "B") + payload[-1]
    assert s.verify(f"{flipped}.{mac}", "team-a", "team-a|S", "m") == (None, "forged")
    assert ResumeSigner(b"another-secret-of-another-stack", wall).verify(tok, "team-a", "team-a|S", "m") == (None, "forged")
    assert s.verify(tok, "team-b", "team-a|S", "m")[1] == "wrong_tenant"
    assert s.verify(tok, "team-a", "team-a|T", "m")[1] == "wrong_session"
    assert s.verify(tok, "team-a", "team-a|S", "n")[1] == "wrong_model"
    for junk in ("", "abc", "a.b.c", "!!!.???", "x" * 5000):
        assert s.verify(junk, "team-a", "team-a|S", "m")[1] == "malformed"
    wall.t = 1010.0
    assert s.verify(tok, "team-a", "team-a|S", "m") == (None, "expired")
    with pytest.raises(ValueError):
        ResumeSigner(b"short", wall)


def _leases(wall: Wall, epoch: int = 7) -> LeaseService:
    """A router replica's lease service over a gateway that knows two instances (e0 at ``epoch``)."""
    clock = ManualClock(5.0)
    reg = Registry(clock, miss_limit=3, stale_after=2, wall=wall)
    gw = Gateway(PolicyParams(), reg, SessionTable(clock), LeaseTable(), wall, tau_s=10.0)
    snap = pb.InstanceSnapshot(instance_id="e0", epoch=epoch, seq=1, heartbeat_period_s=30, sent_unix=wall() - 5)
    snap.models.append(pb.ModelState(model="m", loaded=True, active=True, max_context=4096))
    other = pb.InstanceSnapshot(instance_id="e1", epoch=3, seq=1, heartbeat_period_s=30, sent_unix=wall() - 5)
    other.models.append(pb.ModelState(model="m", loaded=True, active=True, max_context=4096))
    gw.on_snapshot(snap)
    gw.on_snapshot(other)
    return LeaseService(gw)


def _g(session="team-a|S", tenant="team-a", rid="req-1") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, session_id=session, tenant=tenant, model="m")


def test_a_replica_that_never_saw_the_lease_honours_the_token_once():
    wall = Wall()
    issuer, other = _leases(wall), _leases(wall)
    r1, r2 = Resumes(ResumeSigner(SECRET, wall), Counter()), Resumes(ResumeSigner(SECRET, wall), Counter())
    tok = r1.issue_for(issuer, _g(), "e0", 7, cpb.Usage(prompt_tokens=30, completion_tokens=11))
    wall.t += 1.0
    req = other.gw.request("team-a|S", "m", 50, 8)
    d0, _ = other.gw.decide(req)
    assert d0.lease == "none"  # without the token: the replica knows no lease
    c = r2.apply(tok, _g(rid="req-2"), other)
    assert c is not None and c.committed_tokens == 40 and r2.counters["resume_token_ok"] == 1
    d, rev = other.gw.decide(req)
    assert (d.lease, d.instance_id, rev) == ("hit", "e0", 0)
    r2.consumed(c.lease_id)
    assert r2.apply(tok, _g(rid="req-3"), other) is None and r2.counters["resume_token_replayed"] == 1


@pytest.mark.parametrize("what", ["forged", "expired", "wrong_tenant"])
def test_bad_tokens_are_ignored_and_counted(what):
    wall = Wall()
    ls = _leases(wall)
    gw = ls.gw
    r = Resumes(ResumeSigner(SECRET, wall), Counter())
    good = ResumeSigner(SECRET, wall).issue(claim())
    tok = {"forged": ResumeSigner(b"attacker-made-up-secret-0000", wall).issue(claim()), "expired": good, "wrong_tenant": good}[what]
    if what == "expired":
        wall.t = 2000.0
    g = _g(session="team-b|S", tenant="team-b") if what == "wrong_tenant" else _g()
    assert r.apply(tok, g, ls) is None
    assert r.counters[f"resume_token_{what}"] == 1 and len(gw.leases) == 0
    d, _ = gw.decide(gw.request(g.session_id, "m", 50, 8))
    assert d.lease == "none" and d.reason == "cost"  # normal placement


def test_token_of_an_engine_epoch_the_router_knows_is_gone_is_not_honoured():
    wall = Wall()
    ls = _leases(wall, epoch=8)  # e0 restarted: epoch 7 -> 8
    gw = ls.gw
    r = Resumes(ResumeSigner(SECRET, wall), Counter())
    assert r.apply(ResumeSigner(SECRET, wall).issue(claim(epoch=7)), _g(), ls) is not None
    d, rev = gw.decide(gw.request("team-a|S", "m", 50, 8))
    assert (d.lease, rev) == ("prefix-invalid", 0)


def test_no_token_without_a_session_or_with_leases_off():
    wall = Wall()
    ls = _leases(wall)
    gw = ls.gw
    r = Resumes(ResumeSigner(SECRET, wall), Counter())
    u = cpb.Usage(prompt_tokens=3, completion_tokens=2)
    assert r.issue_for(ls, _g(session=""), "e0", 7, u) is None
    tok = r.issue_for(ls, _g(), "e0", 7, u)
    gw.tau_s = 0.0
    assert r.issue_for(ls, _g(), "e0", 7, u) is None
    assert r.apply(tok, _g(rid="req-2"), ls) is None and len(gw.leases) == 0  # leases off: not even installed
    assert r.counters["resume_token_leases_off"] == 1
