"""Unified residency on the real cold engine (issue 16, JointServe §3/§4.2): plans stay within the device
budget, the staging area holds exactly the planned layer-group prefixes, session prefixes outside the target
leave the device, and outputs are unchanged."""

from __future__ import annotations

import pytest

from services.engine.cold.engine import ColdEngine
from services.engine.cold.residency import ResidencyDriver
from services.engine.executor import Engine
from services.engine.substrate.groups import group_of_layer, layer_groups
from services.engine.substrate.staging import ChunkState
from services.engine.substrate.switch import kv_page_bytes
from services.engine.types import EngineRequest, SamplingParams
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture

PAGE = 4
MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class StepClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.002
        return self.t


def make(synth_models, kv_mb=24, budget_fraction=1.0):
    clock = StepClock()
    drv = ResidencyDriver(every_steps=1, chunks_per_step=64, budget_fraction=budget_fraction)
    ce = ColdEngine({m: synth_models[m] for m in MODELS}, clock=clock, page_size=PAGE, kv_cache_bytes=kv_mb << 20,
                    chunk_bytes=256 * 1024, runtime_bytes=64 * 1024, residency=drv)
    return ce, drv, clock


def test_layer_groups_cover_the_image_in_order(synth_models):
    ce, _, _ = make(synth_models)
    for m in MODELS:
        e = ce.bank[m]
        gs = layer_groups(e)
        assert len(gs) == e.config.num_hidden_layers and gs[0].lo == 0 and gs[-1].hi == e.nbytes
        assert all(a.hi == b.lo for a, b in zip(gs, gs[1:]))
        assert sorted(j for g in gs for j in g.chunks) == list(range(e.num_chunks))
        assert group_of_layer(gs, e.config.num_hidden_layers) == gs[-1].index
    with pytest.raises(ValueError):
        layer_groups(ce.bank[MODELS[0]], 0)


def _run(ce, outs):
    while ce.has_unfinished():
        for o in ce.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)


def test_plans_drive_staging_within_budget_and_outputs_are_unchanged(synth_models):
    ce, drv, _ = make(synth_models)
    a, b, c = MODELS
    ref = {m: Engine(synth_models[m], page_size=PAGE, num_pages=256).generate([[5, 6, 7, 8, 9]], GREEDY)[0] for m in MODELS}
    outs: dict = {}
    ce.add_request(EngineRequest("s1", [5, 6, 7, 8, 9], GREEDY, session_id="sess", model=a))
    _run(ce, outs)
    assert outs["s1"] == ref[a] and ("kv", a, "sess") in drv.plan.target  # room for all: the prefix stays
    ce.add_request(EngineRequest("b1", [5, 6, 7, 8, 9], GREEDY, model=b))
    ce._drain_intake()  # queued, not yet switched: the plan sees b's intent
    for _ in range(20):
        ce._stage()
        p = drv.plan
        assert p.target_bytes <= p.budget_bytes and p.shortfall_bytes == 0
    p = drv.plan
    assert p.weight_prefix(b) == len(layer_groups(ce.bank[b])) and p.weight_prefix(c) == 0  # c: no intent, no history
    area = ce.substrate.area
    area.poll(wait=True)
    staged = {(ch.model, ch.index) for ch in area.chunks.values() if ch.state is ChunkState.CLEAN}
    assert staged == {(b, j) for j in range(ce.bank[b].num_chunks)}  # exactly the plan's groups
    assert {ch.key: ch.why for ch in p.choices}[("kv", a, "<in-flight>")] == "protected"
    _run(ce, outs)
    assert outs["b1"] == ref[b]
    assert ce.switch_records[-1].to_model == b and ce.switch_records[-1].path == "full_staged"
    assert ce.residency.snapshot()["version"] >= 1
    ce.check_integrity()


def test_under_one_budget_a_stale_session_prefix_yields_to_an_intended_model(synth_models):
    """The KV prefix and b's first layer group do not both fit: a recent session keeps its prefix (recompute
    is dear), a session idle for long gives it up to the model with queued calls."""
    a, b, _ = MODELS
    probe, _, _ = make(synth_models)  # sizes: the KV region and the staging slots b's first group takes
    pages = probe.shell(a).kv.num_pages
    budget = layer_groups(probe.bank[b])[0].chunks.stop * probe.substrate.area.k * probe.substrate.area.geom.seg_bytes + 8192
    ce, drv, clock = make(synth_models, budget_fraction=budget / (pages * kv_page_bytes(probe.bank[a], PAGE)))
    outs: dict = {}
    ce.add_request(EngineRequest("s1", [5, 6, 7, 8, 9], GREEDY, session_id="sess", model=a))
    _run(ce, outs)
    ce.add_request(EngineRequest("b1", [5, 6, 7, 8, 9], GREEDY, model=b))
    ce._drain_intake()
    ce._stage()
    why = {ch.key: ch.why for ch in drv.plan.choices}
    assert why[("kv", a, "sess")] == "selected" and why[("weights", b, 0)] != "selected"
    assert "sess" in ce.shell(a).kv.sessions
    clock.t += 1000.0  # the session has been idle far longer than its expected tool gap
    ce._stage()
    why = {ch.key: ch.why for ch in drv.plan.choices}
    assert why[("weights", b, 0)] == "selected" and why[("kv", a, "sess")] == "outvalued"
    assert ("offload", ("kv", a, "sess")) in [(x.op, x.key) for x in drv.plan.actions]
    assert "sess" not in ce.shell(a).kv.sessions and drv.released_sessions == 1
    assert drv.plan.target_bytes <= drv.plan.budget_bytes
    _run(ce, outs)
    ce.check_integrity()


def test_engine_config_switch_builds_the_driver():
    from talaria.config import EngineConfig

    cfg = EngineConfig(id="c", pool="cold", models=["a", "b"], unified_residency=True, partial_layers=True)
    assert cfg.unified_residency and cfg.partial_layers and not EngineConfig(id="c", pool="cold", models=["a"]).unified_residency


def test_with_streaming_a_cold_model_keeps_only_its_startup_prefix(synth_models):
    """partial_layers + unified_residency: groups past k* stream in behind the first prefill, so the plan gives
    them no recovery value and keeps (stages) only the startup prefix."""
    drv = ResidencyDriver(every_steps=1, chunks_per_step=64)
    ce = ColdEngine({m: synth_models[m] for m in MODELS}, clock=StepClock(), page_size=PAGE, kv_cache_bytes=24 << 20,
                    chunk_bytes=256 * 1024, runtime_bytes=64 * 1024, residency=drv, partial_layers=True)
    try:
        a, b, _ = MODELS
        asked = []
        ce.streamer.k_for = lambda m, tokens: asked.append((m, tokens)) or 2  # the measured k* (here fixed)
        ce.add_request(EngineRequest("b1", [5, 6, 7, 8, 9], GREEDY, model=b))
        ce._drain_intake()
        ce._stage()
        p = drv.plan
        assert (b, 5) in asked and p.weight_prefix(b) == 2
        why = {c.key: (c.why, c.recovery_path) for c in p.choices}
        assert why[("weights", b, 2)] == ("no_value", "stream") and why[("weights", b, 1)] == ("selected", "reload")
        ce.substrate.area.poll(wait=True)
        staged = {(ch.model, ch.index) for ch in ce.substrate.area.chunks.values() if ch.state is ChunkState.CLEAN}
        assert staged == {(b, j) for g in layer_groups(ce.bank[b])[:2] for j in g.chunks}
    finally:
        ce.streamer.transfer.close()
