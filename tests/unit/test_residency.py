"""The unified residency manager (issue 16, JointServe §3): budget never exceeded (property test over random
objects, budgets and arrivals), legal prefixes, (1−ε) of the brute-force optimum, diff actions, versions and
the choices explained as data."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.residency import ResidencyManager, ResidencyObject, ReuseSignals, select

MiB = 1 << 20


def weights(model, group, nbytes, reuse, recovery, **kw):
    return ResidencyObject("weights", model, nbytes, recovery, reuse, group=group, **kw)


def kv(model, session, nbytes, reuse, recovery, **kw):
    return ResidencyObject("kv", model, nbytes, recovery, reuse, session=session, **kw)


@st.composite
def instances(draw):
    objs = []
    for m in range(draw(st.integers(0, 3))):
        prot_prefix = draw(st.integers(0, 2))
        for g in range(draw(st.integers(1, 5))):
            objs.append(weights(f"m{m}", g, draw(st.integers(1, 64)) * 1024, draw(st.floats(0, 3)), draw(st.floats(0, 2)),
                                resident=draw(st.booleans()), protected=g < prot_prefix))
    for s in range(draw(st.integers(0, 6))):
        objs.append(kv("m0", f"s{s}", draw(st.integers(1, 64)) * 1024, draw(st.floats(0, 1)), draw(st.floats(0, 5)),
                       resident=draw(st.booleans()), protected=draw(st.booleans()) and s == 0, host_copy=draw(st.booleans())))
    return objs, draw(st.integers(0, 600)) * 1024


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(instances())
def test_a_plan_never_exceeds_the_budget_and_keeps_protected_state(inst):
    objs, budget = inst
    plan = ResidencyManager().plan(objs, budget)
    size = {o.key: o.nbytes for o in objs}
    assert plan.target_bytes == sum(size[k] for k in plan.target)
    protected = {o.key for o in objs if o.protected}
    assert protected <= plan.target
    if plan.shortfall_bytes:
        assert plan.target == protected and plan.shortfall_bytes == plan.protected_bytes - budget
    else:
        assert plan.target_bytes <= budget
    for o in objs:  # the diff is exactly target vs residency
        ops = [a.op for a in plan.actions if a.key == o.key]
        if o.key in plan.target and not o.resident:
            assert ops == ["load" if o.kind == "weights" else "restore"]
        elif o.key not in plan.target and o.resident:
            assert ops == ["release" if o.host_copy else "offload"]
        else:
            assert ops == []
    for m in {o.model for o in objs if o.kind == "weights"}:  # unprotected groups are kept as a prefix
        free = sorted(o.group for o in objs if o.kind == "weights" and o.model == m and not o.protected)
        kept = [g for g in free if ("weights", m, g) in plan.target]
        assert kept == free[: len(kept)]
    assert len(plan.choices) == len(objs) and all(c.selected == (c.key in plan.target) for c in plan.choices)


def _brute(objs, cap):
    best = 0.0
    models = sorted({o.model for o in objs if o.kind == "weights"})
    kvs = [o for o in objs if o.kind == "kv"]
    groups = {m: sorted((o for o in objs if o.kind == "weights" and o.model == m), key=lambda o: o.group) for m in models}
    for ks in itertools.product(*[range(len(groups[m]) + 1) for m in models]):
        chosen = [g for m, k in zip(models, ks) for g in groups[m][:k]]
        for mask in range(1 << len(kvs)):
            sel = chosen + [o for i, o in enumerate(kvs) if mask >> i & 1]
            if sum(o.nbytes for o in sel) <= cap:
                best = max(best, sum(o.value for o in sel))
    return best


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(instances())
def test_selection_is_within_epsilon_of_the_brute_force_optimum(inst):
    objs, budget = inst
    objs = [o for o in objs if not o.protected][:9]
    keys, value, _ = select(objs, budget, epsilon=0.05)
    opt = _brute(objs, budget)
    assert value >= (1 - 0.05) * opt - 1e-9
    assert sum(o.nbytes for o in objs if o.key in keys) <= max(budget, 0)


def test_seeded_random_arrivals_keep_the_budget_across_replans():
    """Arrivals drive the reuse signals; every plan of the sequence stays within the budget."""
    import random

    rng = random.Random(7)
    sig = ReuseSignals(window_s=5.0)
    mgr = ResidencyManager()
    resident: set = set()
    now = 0.0
    for _ in range(200):
        now += rng.expovariate(2.0)
        sig.observe_call(f"m{rng.randrange(4)}", f"s{rng.randrange(8)}", now)
        objs = [weights(f"m{m}", g, 8 * MiB, sig.model_reuse(f"m{m}", 0, False, now), 0.3, resident=("weights", f"m{m}", g) in resident, protected=m == 0)
                for m in range(4) for g in range(4)]
        objs += [kv("m0", f"s{s}", 2 * MiB, sig.session_reuse(f"s{s}", now), 0.05 * (s + 1), resident=("kv", "m0", f"s{s}") in resident) for s in range(8)]
        plan = mgr.plan(objs, 64 * MiB)
        assert plan.target_bytes <= 64 * MiB
        resident = set(plan.target)


def test_recompute_bound_kv_outweighs_a_reloadable_group_and_choices_say_why():
    """JointServe §3.2: equal-size objects, different recovery paths: the recompute-bound prefix is kept."""
    objs = [
        weights("a", 0, 4 * MiB, 1.0, 0.2, protected=True, resident=True),
        weights("b", 0, 4 * MiB, 0.5, 0.16),  # reload 0.16 s, half likely
        weights("b", 1, 4 * MiB, 0.5, 0.16),
        kv("a", "long", 4 * MiB, 0.9, 2.6, resident=True, host_copy=False, recovery_path="recompute"),
        kv("a", "short", 4 * MiB, 0.9, 0.05, resident=True, recovery_path="restore"),
        kv("a", "huge", 64 * MiB, 1.0, 9.0, resident=True, host_copy=False, recovery_path="recompute"),
    ]
    mgr = ResidencyManager()
    plan = mgr.plan(objs, 16 * MiB)
    why = {c.key: c.why for c in plan.choices}
    assert ("kv", "a", "long") in plan.target and ("weights", "a", 0) in plan.target
    assert why[("kv", "a", "huge")] == "too_big" and why[("weights", "a", 0)] == "protected"
    assert plan.target_bytes <= 16 * MiB and plan.weight_prefix("a") == 1
    ops = {a.key: a.op for a in plan.actions}
    assert ops[("kv", "a", "huge")] == "offload"  # no host copy: write back before release
    assert [a.op for a in plan.actions][0] == "offload"  # write-backs are ordered first
    v = plan.version
    assert mgr.plan(objs, 16 * MiB).version == v  # same target: same version
    assert mgr.plan(objs, 32 * MiB).version == v + 1
    assert plan.to_dict()["choices"][0]["why"] == "protected"


def test_protected_state_beyond_the_budget_is_a_shortfall():
    objs = [weights("a", 0, 10 * MiB, 1.0, 1.0, protected=True, resident=True), kv("a", "s", 1 * MiB, 1.0, 1.0, resident=True)]
    plan = ResidencyManager().plan(objs, 8 * MiB)
    assert plan.shortfall_bytes == 2 * MiB and plan.target == {("weights", "a", 0)}
    assert [(a.op, a.key) for a in plan.actions] == [("release", ("kv", "a", "s"))]
    assert {c.key: c.why for c in plan.choices}[("kv", "a", "s")] == "shortfall"


def test_bad_objects_are_refused():
    mgr = ResidencyManager()
    with pytest.raises(ValueError):
        mgr.plan([weights("a", 0, 1, 1.0, 1.0), weights("a", 0, 1, 1.0, 1.0)], 10)
    with pytest.raises(ValueError):
        mgr.plan([weights("a", 0, -1, 1.0, 1.0)], 10)
    with pytest.raises(ValueError):
        ResidencyManager(epsilon=0)


def test_reuse_signals_intent_first_then_rate_and_session_recency():
    sig = ReuseSignals(window_s=10.0)
    assert sig.model_reuse("x", queued=3, requested=False, now=0.0) == 3.0
    assert sig.model_reuse("x", queued=0, requested=True, now=0.0) == 1.0
    assert sig.model_reuse("x", queued=0, requested=False, now=0.0) == 0.0
    for t in (0.0, 1.0, 2.0):
        sig.observe_call("x", "s", t)
    assert sig.model_reuse("x", 0, False, 2.0) == pytest.approx(10.0)  # 1 call/s over a 10 s window
    assert sig.model_reuse("x", 0, False, 12.0) < sig.model_reuse("x", 0, False, 3.0)
    assert sig.session_reuse("s", 2.0) == pytest.approx(1.0) and sig.session_reuse("s", 4.0) == pytest.approx(pytest.approx(0.1353, abs=1e-3))
    assert sig.session_reuse("nobody", 4.0) == 0.0
