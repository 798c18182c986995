"""The §5.3 router testbed in the simulator (issue 48): what an avoidable open is, where it is counted, and what
an open is priced with. Small hand-built states on the testbed's two workers; no full runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from sim import paper
from sim.cluster import Simulation
from sim.instance import SimCall
from sim.profile import load

TP4 = Path(__file__).resolve().parents[2] / "profiles" / "paper-tp4-router.yaml"
M0, M1, M2 = paper.ROUTER_MODELS  # tp4-0 starts with M0 on its device, tp4-1 with M2; M1 is resident nowhere


def _sim(policy: str = "least-pressure", **cfg) -> Simulation:
    return Simulation(replace(paper.router_config(load(TP4), policy), **cfg), [])


def _call(sid: str, model: str, k: int = 0) -> SimCall:
    return SimCall(f"{sid}#{k}", sid, k, model, 4000, 0, 8, 0.0)


def _publish(sim: Simulation) -> None:
    for iid in sim.instances:
        sim._publish(iid)


def test_the_testbed_is_two_workers_with_one_device_resident_model_each():
    """§5.4: model opens 33 / 47 / 56 = (1 - model-residency hit) x 120 calls, ~40 % of calls: one model on
    each worker's device and one resident nowhere; every model is in both workers' weight bank (rotation)."""
    sim = _sim()
    assert sim.cfg.device_residency
    w0, w1 = sim.instances["tp4-0"], sim.instances["tp4-1"]
    assert (w0.active, w1.active) == (M0, M2) and set(w0.loaded) == set(w1.loaded) == {M0, M1, M2}
    _publish(sim)
    seen = {c.instance_id: {m: r.loaded for m, r in c.models.items()} for c in sim.gateway.instance_states()}
    assert seen == {"tp4-0": {M0: True, M1: False, M2: False}, "tp4-1": {M0: False, M1: False, M2: True}}


def test_an_avoidable_open_is_an_open_of_a_model_another_worker_has_on_its_device():
    """§5.3: "an avoidable cold open when the selected worker must open the requested model even though another
    worker already has that model resident". A model in a worker's rotation (queued there) but not on its device
    is not resident: the device must load it (before issue 48 the rotation counted, so once every model had been
    queued on both workers nothing was an open and least-pressure's count stalled at 15)."""
    sim = _sim("least-pressure")
    w0, w1 = sim.instances["tp4-0"], sim.instances["tp4-1"]
    assert w0.submit(_call("q0", M2), 0.0)  # M2 queued on tp4-0: in its rotation, not on its device
    for i in range(2):
        assert w1.submit(_call(f"q{i + 1}", M2), 0.0)
    _publish(sim)
    gw = sim.gateway
    d, _ = gw.decide(gw.request("new", M2, 4000, 8))
    assert d.instance_id == "tp4-0"  # least-pressure: 1 call there, 2 on tp4-1
    assert d.opens_model and d.avoidable_open  # tp4-1 has M2 on its device
    d1, _ = gw.decide(gw.request("new1", M1, 4000, 8))
    assert d1.opens_model and not d1.avoidable_open  # M1 is on neither device: an open, not avoidable
    # the workers' own count (cluster._count_open) agrees
    sim._count_open("tp4-0", M2)
    sim._count_open("tp4-0", M1)
    sim._count_open("tp4-0", M0)  # on its device: no open
    assert sim.worker_opens == {"opens": 2, "avoidable_opens": 1}
    # the full router sends the same call to the worker that has M2 on its device
    full = _sim("full")
    _publish(full)
    d, _ = full.gateway.decide(full.gateway.request("new", M2, 4000, 8))
    assert d.instance_id == "tp4-1" and not d.opens_model


def test_an_open_is_priced_with_the_wait_for_its_turn_in_the_rotation():
    """A catalog model a busy cold worker would have to open joins its rotation after the open slots (the slot
    scheduler's "" wait). Before issue 48 the heartbeat listed only the rotation's models, so an open was priced
    as if it could start at once (0 s wait) while a switch to a model already in the rotation carried the wait:
    opening a second replica looked cheaper than switching on the same worker. Rotation residency, one model per
    rotation (the testbed before issue 48)."""
    prof = paper.replace_knobs(load(TP4), max_loaded=1)
    sim = Simulation(replace(paper.router_config(prof, "full"), device_residency=False), [])
    w0 = sim.instances["tp4-0"]
    assert w0.loaded == [M0]
    for i in range(3):
        assert w0.submit(_call(f"b{i}", M0), 0.0)
    sim._kick("tp4-0")  # the slot opens and its first step starts
    waits = w0.scheduler.slot_waits(sim.clock.now(), False)
    assert waits[""] > 0
    snap = sim.snapshot("tp4-0")
    by = {m.model: m for m in snap.models}
    assert not by[M1].loaded and by[M1].slot_wait_s == pytest.approx(waits[""])
    _publish(sim)
    d, _ = sim.gateway.decide(sim.gateway.request("new", M1, 4000, 8))
    c = {x.instance_id: x for x in d.costs}["tp4-0"]
    assert c.act == "open" and c.c_act == pytest.approx(sim.gateway.instance_states()[0].profile.open_s + waits[""], rel=1e-6)
