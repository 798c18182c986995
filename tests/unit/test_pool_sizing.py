"""Pool sizing (services/router/pool_sizing.py): pure decisions under an injected clock."""

from __future__ import annotations

from services.router.pool_sizing import InstanceInfo, PoolParams, PoolSizer, offered_work
from talaria.clock import ManualClock


def _cluster():
    return [InstanceInfo("h0", "hot", ("a",), True), InstanceInfo("h1", "hot", ("a",), True),
            InstanceInfo("c0", "cold", ("x", "b"), True), InstanceInfo("c1", "cold", ("y",), True), InstanceInfo("c2", "cold", ("z",), False)]


def test_promotes_the_model_over_its_hot_capacity_onto_an_idle_cold_instance_that_has_it_loaded():
    s = PoolSizer(PoolParams(min_cold=1), ManualClock().now)
    moves = s.decide({"a": 1.5, "b": 2.5, "x": 0.1}, _cluster())
    assert [(m.instance_id, m.to_pool, m.model) for m in moves] == [("c0", "hot", "b")]  # one per model per period
    # min_cold: with 3 cold instances and min_cold 3 nothing may leave the cold pool
    assert PoolSizer(PoolParams(min_cold=3), ManualClock().now).decide({"a": 1.5, "b": 2.5}, _cluster()) == []


def test_demotes_with_hysteresis_and_respects_the_cooldown():
    clock = ManualClock()
    s = PoolSizer(PoolParams(demote_util=0.4, cooldown_s=100.0), clock.now)
    assert s.decide({"a": 0.5}, _cluster()) == []  # 0.5 > 0.4 x (2-1): both hot instances stay
    moves = s.decide({"a": 0.3}, _cluster())
    assert [(m.instance_id, m.to_pool) for m in moves] == [("h0", "cold")]
    insts = [InstanceInfo("h0", "cold", ("a",), True), InstanceInfo("h1", "hot", ("a",), True),
             InstanceInfo("c1", "cold", ("y",), True), InstanceInfo("c9", "cold", ("y",), False)]
    assert [m.instance_id for m in s.decide({"a": 3.0}, insts)] == ["c1"]  # h0 (a loaded) is still cooling down
    clock.advance(100.0)
    assert [m.instance_id for m in s.decide({"a": 3.0}, insts)] == ["h0"]  # cooled: preferred, it has a loaded


def test_a_model_below_one_instance_of_work_stays_in_the_cold_pool():
    s = PoolSizer(PoolParams(), ManualClock().now)
    assert s.decide({"a": 1.5, "b": 0.5}, _cluster()) == []


def test_offered_work_is_rate_times_call_cost():
    w = offered_work({"a": 2.0}, {"a": 1000.0}, {"a": 100.0}, prefill_per_token=1e-4, decode_step=0.01, batch=2.0)
    assert abs(w["a"] - 2.0 * (0.1 + 0.5)) < 1e-12
