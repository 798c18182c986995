"""Health that tells slow from dead (issue 12 item 4, issue 18 item 9, router part): a miss limit in seconds,
suspect (no new calls, in-flight calls go on) before dead (in-flight calls aborted), death declared at once
by NATS no-responders, and every state change reported once for the log. Manual clock, no NATS."""

from __future__ import annotations

from services.router.registry import Registry
from talaria.clock import ManualClock
from talaria.v1 import engine_pb2 as pb


def snap(iid, seq=1, epoch=1, period=0.2, draining=False):
    s = pb.InstanceSnapshot(instance_id=iid, epoch=epoch, seq=seq, heartbeat_period_s=period, draining=draining)
    s.models.append(pb.ModelState(model="m", loaded=True, max_context=1024))
    return s


def registry(clock):
    # the service's defaults: 3 periods (0.6 s at 0.2 s) but at least 2 s; dead after 20 s of silence
    return Registry(clock, miss_limit=3, stale_after=2, miss_limit_s=2.0, dead_after_s=20.0)


def test_a_late_instance_is_suspect_not_dead():
    clock = ManualClock(10.0)
    reg = registry(clock)
    reg.observe(snap("a"))
    v = reg.instances["a"]
    clock.advance(1.5)  # 7.5 heartbeat periods late, under 2 s: a loaded engine, still placeable
    assert reg.healthy(v) and reg.alive(v) and reg.state(v) == "ok"
    clock.advance(1.0)  # 2.5 s: suspect, no new calls, in-flight calls go on
    assert not reg.healthy(v) and reg.alive(v) and reg.state(v) == "suspect"
    assert reg.candidates("m") == [] and reg.silent() == ["a"]
    clock.advance(17.0)  # 19.5 s
    assert reg.alive(v)
    clock.advance(1.0)  # 20.5 s: a long silence is death
    assert not reg.alive(v) and reg.state(v) == "dead" and reg.silent() == []
    reg.observe(snap("a", seq=2))  # it was only frozen: back
    assert reg.healthy(v) and reg.state(v) == "ok"


def test_no_responders_declares_death_at_once_and_a_restart_revives():
    clock = ManualClock(10.0)
    reg = registry(clock)
    reg.observe(snap("a"))
    clock.advance(2.5)
    reg.mark_gone("a", "NATS: no responders")
    v = reg.instances["a"]
    assert not reg.alive(v) and reg.state(v) == "dead" and reg.why(v) == "NATS: no responders"
    assert "a" in reg.take_changed()
    reg.observe(snap("a", seq=1, epoch=2))  # restarted engine, new epoch
    assert reg.alive(v) and reg.healthy(v)


def test_deadlines_cover_suspect_and_dead_limits():
    clock = ManualClock(10.0)
    reg = registry(clock)
    reg.observe(snap("a"))
    due = reg.deadlines(reg.instances["a"])
    assert 12.0 in due and 30.0 in due


def test_sweep_reports_each_change_once_with_its_reason():
    clock = ManualClock(10.0)
    reg = registry(clock)
    reg.observe(snap("a"))
    reg.observe(snap("b", draining=True))
    assert sorted(reg.sweep()) == [("a", "new", "ok", "heartbeats on time"), ("b", "new", "draining", "draining")]
    assert reg.sweep() == []
    clock.advance(2.5)
    reg.observe(snap("b", seq=2, draining=True))
    (change,) = reg.sweep()
    assert change[:3] == ("a", "ok", "suspect") and "no heartbeat for 2.5s" in change[3]
    reg.mark_suspect("b", 5.0)
    assert reg.sweep() == [("b", "draining", "suspect", "did not accept a call in time")]
    clock.advance(21)
    assert [c[:3] for c in reg.sweep()] == [("a", "suspect", "dead"), ("b", "suspect", "dead")]
