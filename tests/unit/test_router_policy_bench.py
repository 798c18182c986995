"""Smoke test of ``talaria bench placement`` (simulation): it runs, is deterministic, and the full router
keeps returning sessions on their worker at least as often as least-pressure on the same workload."""

from __future__ import annotations

from bench.router_policy_bench import SimProfile, decision_cost, replay, workload


def test_replay_is_deterministic_and_full_router_keeps_affinity():
    prof = SimProfile()
    runs = {}
    for policy in ("full", "least-pressure", "session-sticky"):
        a = replay(policy, 1.0, workload(3, 8, 4, 3.0), prof, slots=2)
        b = replay(policy, 1.0, workload(3, 8, 4, 3.0), prof, slots=2)
        assert [c.first_token for c in a["calls"]] == [c.first_token for c in b["calls"]]
        assert all(c.done >= c.first_token >= c.arrival for c in a["calls"])
        runs[policy] = a["stats"]
    rate = {p: s["same_instance_returns"] / s["returns"] for p, s in runs.items()}
    assert rate["session-sticky"] == 1.0
    assert rate["full"] >= rate["least-pressure"]
    assert runs["full"]["lease_hits"] > 0 and runs["least-pressure"]["lease_hits"] == 0


def test_decision_cost_reports_per_size():
    rows = decision_cost([4, 8], seed=0)
    assert [r["instances"] for r in rows] == [4, 8] and all(r["decide_us"] > 0 for r in rows)
