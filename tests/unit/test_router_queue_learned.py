"""Eq. 1's queue term learned from the engines' measured queueing (issue 12 #2; ``profiles.QueueBook``,
``router.placement.queue_learned``): pure book, then the gateway end to end (decisions -> completion hooks
with the engine's attribution -> the pressure it prices)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from services.router.policy import PolicyParams, decide, PlacementState, SessionView, KV_DEVICE
from services.router.profiles import QueueBook
from talaria.clock import ManualClock
from talaria.v1 import common_pb2 as cpb
from talaria.v1 import engine_pb2 as pb
from tests.unit.test_router_placement import inst, make_gateway, place, req, snapshot


def test_queue_book_learns_the_ratio_of_measured_to_predicted_queueing():
    qb = QueueBook(alpha=0.5, min_samples=3)
    assert qb.scale("a") == 1.0  # nothing measured anywhere: the configured weights as they are
    qb.observe("a", 0.2, 0.02)
    qb.observe("a", 0.2, 0.02)
    assert qb.scale("a") == 1.0  # fewer than min_samples
    qb.observe("a", 0.2, 0.02)
    assert qb.scale("a") == pytest.approx(0.1)
    assert qb.scale("b") == pytest.approx(0.1)  # unmeasured: the measured instances' median
    for _ in range(3):
        qb.observe("c", 0.1, 10.0)  # an engine far slower to admit than predicted: bounded
    assert qb.scale("c") == qb.hi
    for bad in ((math.nan, 0.1), (0.1, -1.0), (-0.1, 0.1)):
        qb.observe("a", *bad)  # ignored
    assert qb.stats()["a"]["samples"] == 3
    for _ in range(3):
        qb.observe("z", 0.0, 0.5)  # Eq. 1 predicted no queue at all there: nothing to scale, not an infinite ratio
    assert qb.scale("z") in (pytest.approx(0.1), qb.hi)  # the median of a and c
    qb.forget("a")
    assert "a" not in qb.stats()
    with pytest.raises(ValueError):
        QueueBook(lo=2.0)


def test_scaled_pressure_lets_the_session_keep_its_device_kv():
    """The instance holding the session's KV has 4 running calls: at the configured weights (0.5 a running
    call) that is 2 mean calls of queue, more than the 600-token recompute elsewhere saves, so the call moves
    away. Measured, those running calls delay a new one by a fiftieth of that: it stays with its KV."""
    busy = dict(running=4, kv={("s", "m"): (KV_DEVICE, 600)})
    session = SessionView("m", "a", "a", 600, 0.0)
    params = PolicyParams(replica_penalty_s=0, hbm_price_s_per_gib=0, charge_imposed=False)
    configured = decide(PlacementState(req(prompt=800), [inst("a", **busy), inst("b")], params, session=session), now=0.0)
    measured = decide(PlacementState(req(prompt=800), [inst("a", queue_scale=0.02, **busy), inst("b")], params, session=session), now=0.0)
    assert configured.instance_id == "b" and measured.instance_id == "a"
    qa = {c.instance_id: c.queue_s for c in configured.costs}["a"]
    assert {c.instance_id: c.queue_s for c in measured.costs}["a"] == pytest.approx(0.02 * qa)


def _attr_hook(iid: str, rid: str, clock, engine_queue_s: float, error: bool = False) -> pb.CompletionHook:
    h = pb.CompletionHook(request_id=rid, model="m", instance_id=iid, finish_unix=clock.now(),
                          attribution=cpb.CallAttribution(engine_queue_s=engine_queue_s))
    if error:
        h.error.CopyFrom(cpb.Error(code="engine_error", message="x"))
    return h


def test_gateway_learns_the_scale_from_its_decisions_and_the_engines_hooks():
    clock = ManualClock(100.0)
    ls, store = make_gateway(clock)
    gw = ls.gw
    gw.params = replace(gw.params, queue_learned=True)
    seq = 0

    def beat(running: int) -> None:
        nonlocal seq
        seq += 1
        for iid in ("a", "b"):
            gw.on_snapshot(snapshot(iid, seq, clock, running=running))

    beat(4)
    predicted = []
    for i in range(24):
        d = place(ls, store, "", rid=f"r{i}")
        chosen = next(c for c in d.costs if c.instance_id == d.instance_id)
        predicted.append((d.instance_id, chosen.queue_s))
        # the engine admitted it at once (10 ms), though 4 calls were running there
        ls.on_hook(_attr_hook(d.instance_id, f"r{i}", clock, 0.01, error=(i == 23)))
    learned = gw.queues.stats()
    assert sum(v["samples"] for v in learned.values()) == 23  # the failed call teaches nothing
    measured = [v for v in learned.values() if v["samples"] >= gw.queues.min_samples]
    assert measured
    for v in measured:
        assert v["measured_s"] == pytest.approx(0.01)
        assert v["predicted_s"] > 0.5  # the unscaled prediction, also after the scale took effect
        assert v["scale"] == pytest.approx(max(gw.queues.lo, 0.01 / v["predicted_s"]))
    assert predicted[0][1] > 0.5  # the configured weights predicted most of a second
    beat(4)  # the next states price the pressure at the learned scale
    after = {s.instance_id: s.queue_scale for s in gw.instance_states()}
    assert all(s < 0.1 for s in after.values())
    d = gw.decide(gw.request("t", "m", 800, 64))[0]
    assert all(c.queue_s < 0.1 * predicted[0][1] for c in d.costs)
    assert gw.metrics()["queue_calibration"]["learned"] is True
    # off (the default): the same book, the configured weights priced as they are
    gw.params = replace(gw.params, queue_learned=False)
    beat(4)
    assert {s.queue_scale for s in gw.instance_states()} == {1.0}
