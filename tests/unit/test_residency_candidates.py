"""The residency candidates built once (services/engine/residency_candidates.py): exact objects for a scripted
instance state, the startup prefix rule, and the rule that the cold engine and the simulator build candidates
only through it (so the simulator plans with the production code and the two cannot drift apart)."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.residency import ResidencyManager, ResidencyObject, ReuseSignals
from services.engine.residency_candidates import (
    IN_FLIGHT,
    CachedPrefix,
    GroupState,
    InactiveModel,
    InstanceState,
    candidates,
    startup_groups,
)

ROOT = Path(__file__).resolve().parents[2]


def _state(restore: float | None = 2e-4) -> InstanceState:
    return InstanceState(
        active="a", in_flight_bytes=4096, prefill_per_token=1e-3, restore_per_token=restore,
        cached=(CachedPrefix("s-host", "a", 100, 800, 9.0, True), CachedPrefix("s-dev", "a", 50, 400, 5.0, False)),
        inactive=(InactiveModel("b", 2, False, 1, (GroupState(1000, 0.5, True), GroupState(1000, 0.5, False), GroupState(1000, 0.5, False))),
                  InactiveModel("c", 0, True, 3, (GroupState(3000, 1.5, False),))),
    )


def test_a_scripted_state_gives_exactly_these_objects_in_this_order():
    sig = ReuseSignals(window_s=10.0)
    objs = candidates(_state(), sig, now=10.0)
    r_host, r_dev = math.exp(-1.0 / 5.0), math.exp(-5.0 / 5.0)  # never seen: last use from the cache, gap window/2
    assert objs == [
        ResidencyObject("kv", "a", 4096, 0.0, 1.0, resident=True, protected=True, session=IN_FLIGHT),
        ResidencyObject("kv", "a", 800, 2e-4 * 100, r_host, resident=True, session="s-host", host_copy=True, recovery_path="restore"),
        ResidencyObject("kv", "a", 400, 1e-3 * 50, r_dev, resident=True, session="s-dev", host_copy=False, recovery_path="recompute"),
        ResidencyObject("weights", "b", 1000, 0.5, 2.0, group=0, resident=True, recovery_path="reload"),  # startup prefix: 1 group
        ResidencyObject("weights", "b", 1000, 0.0, 2.0, group=1, resident=False, recovery_path="stream"),
        ResidencyObject("weights", "b", 1000, 0.0, 2.0, group=2, resident=False, recovery_path="stream"),
        ResidencyObject("weights", "c", 3000, 1.5, 1.0, group=0, resident=False, recovery_path="reload"),  # requested: one reuse
    ]
    assert sig.session_reuse("s-host", 10.0) == r_host  # mutated: the cache's last use is the session's clock
    plan = ResidencyManager().plan(objs, 4096 + 800 + 1000)
    # 1800 bytes free: b's startup group (value 1.0) and the dearer-to-lose s-dev (0.018 vs 0.016) fit together
    assert plan.kept("kv") == [("kv", "a", IN_FLIGHT), ("kv", "a", "s-dev")] and (plan.weight_prefix("b"), plan.weight_prefix("c")) == (1, 0)


@pytest.mark.parametrize("restore", [None, 0.0])
def test_without_a_restore_rate_a_host_copy_is_recomputed(restore):
    objs = candidates(_state(restore), ReuseSignals(), now=10.0)
    s = next(o for o in objs if o.session == "s-host")
    assert (s.recovery_path, s.recovery_s, s.host_copy) == ("recompute", 1e-3 * 100, True)


def test_a_restore_dearer_than_recompute_costs_the_recompute():
    s = next(o for o in candidates(_state(5e-3), ReuseSignals(), now=10.0) if o.session == "s-host")
    assert (s.recovery_path, s.recovery_s) == ("restore", 1e-3 * 100)


def test_startup_groups_without_streaming_all_else_k_for_the_first_forward_or_the_usual_prompt():
    def never() -> int:
        raise AssertionError("the first forward is asked only with streaming")

    assert startup_groups(8, None, never, 500.0) == 8
    assert startup_groups(8, lambda t: t // 100, lambda: 300, 500.0) == 3  # waiting calls' first forward
    assert startup_groups(8, lambda t: t // 100, lambda: 0, 512.7) == 5  # nothing waits: the usual prompt
    assert startup_groups(8, lambda t: t // 100, lambda: 0, None) == 8  # never seen: all groups


def _constructs(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name]


def test_the_engine_and_the_simulator_build_candidates_only_through_the_shared_function():
    """A second hand-written candidate builder (in the engine's driver or the simulator) fails here: outside
    the policy module and the shared builder no production code constructs a ``ResidencyObject``, and both
    drivers call ``candidates``."""
    allowed = {ROOT / "services/engine/residency.py", ROOT / "services/engine/residency_candidates.py"}
    bad = [f"{p.relative_to(ROOT)}:{ln}" for top in ("services", "sim", "bench", "talaria") for p in sorted((ROOT / top).rglob("*.py"))
           if p not in allowed for ln in _constructs(p, "ResidencyObject")]
    assert not bad, bad
    for driver in ("services/engine/cold/residency.py", "sim/residency.py"):
        assert _constructs(ROOT / driver, "candidates"), f"{driver} does not call residency_candidates.candidates"


def test_the_shared_builder_imports_no_torch_and_no_engine():
    code = "import sys, services.engine.residency_candidates; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('services.engine.') and m.split('.')[2] not in ('residency', 'residency_candidates')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
