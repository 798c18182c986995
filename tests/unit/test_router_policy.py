"""Router state (registry, health, overlay, session table) under a manual clock (no NATS, no HTTP).
Placement itself (Algorithm 1 and the baselines) is tested in test_router_placement.py."""

from __future__ import annotations

from services.router.policy import PlacementState, PolicyParams, decide
from services.router.registry import Registry
from services.router.sessions import SessionTable
from talaria.clock import ManualClock
from talaria.v1 import engine_pb2 as pb


def _req():
    from services.router.policy import CallRequest

    return CallRequest("s", "m", 10, 4, 4.0)


def snap(iid, model="m", running=0, waiting=0, epoch=1, seq=1, period=0.5, draining=False):
    return pb.InstanceSnapshot(
        instance_id=iid,
        epoch=epoch,
        seq=seq,
        heartbeat_period_s=period,
        num_running=running,
        num_waiting=waiting,
        draining=draining,
        models=[pb.ModelState(model=model, loaded=True, max_context=1024)],
    )


def test_health_follows_heartbeats():
    clock = ManualClock()
    reg = Registry(clock, miss_limit=3, stale_after=2)
    reg.observe(snap("a", running=0))
    reg.observe(snap("b", running=5))
    clock.advance(1.1)
    reg.observe(snap("a", running=0, seq=2))
    b = reg.instances["b"]
    assert reg.healthy(b) and not reg.fresh(b)  # 2 periods < 1.1 s <= 3 periods: stale, still healthy
    clock.advance(0.5)  # b last seen 1.6 s ago > 3 x 0.5 s
    assert not reg.healthy(b)
    assert [v.instance_id for v in reg.candidates("m")] == ["a"]


def test_stale_snapshot_is_ignored_and_restart_epoch_accepted():
    reg = Registry(ManualClock())
    assert reg.observe(snap("a", running=2, epoch=5, seq=10))
    assert not reg.observe(snap("a", running=0, epoch=5, seq=9))
    assert not reg.observe(snap("a", running=0, epoch=4, seq=99))
    assert reg.instances["a"].snapshot.num_running == 2
    assert reg.observe(snap("a", running=0, epoch=6, seq=1))


def test_inflight_overlay_counts_until_next_snapshot():
    reg = Registry(ManualClock())
    reg.observe(snap("a"))
    reg.observe(snap("b"))
    reg.forwarded("a")
    reg.forwarded("a")
    assert reg.instances["a"].inflight == 2
    reg.observe(snap("a", seq=2))  # no wall clock: a newer snapshot clears the overlay
    assert reg.instances["a"].inflight == 0


def test_draining_and_suspect_instances_take_no_new_calls():
    clock = ManualClock()
    reg = Registry(clock)
    reg.observe(snap("a", draining=True))
    reg.observe(snap("b"))
    assert [v.instance_id for v in reg.candidates("m")] == ["b"]
    assert reg.alive(reg.instances["a"])  # in-flight calls continue
    reg.mark_suspect("b", 2.0)
    assert reg.candidates("m") == []
    assert decide(PlacementState(_req(), [], PolicyParams()), 0).reason == "no-instance"
    reg.observe(snap("b", seq=2))  # fresh telemetry clears suspicion
    assert [v.instance_id for v in reg.candidates("m")] == ["b"]


def test_models_and_known_model():
    clock = ManualClock()
    reg = Registry(clock)
    reg.observe(snap("a", model="x"))
    assert reg.models() == {"x": 1024}
    clock.advance(100)
    assert reg.models() == {}
    assert reg.known_model("x") and not reg.known_model("y")


def test_session_table_lru_ttl_and_forget():
    clock = ManualClock()
    t = SessionTable(clock, capacity=2, ttl_s=10)
    t.record("s1", "m", "a", 10)
    t.record("s2", "m", "b", 20)
    t.record("s1", "m", "a")  # refresh keeps committed tokens
    assert t.get("s1").committed_tokens == 10
    t.record("s3", "m", "a", 5)  # evicts s2 (least recently used)
    assert t.get("s2") is None and len(t) == 2
    assert t.forget_instance("a") == 2
    t.record("s4", "m", "a")
    clock.advance(11)
    assert t.get("s4") is None
