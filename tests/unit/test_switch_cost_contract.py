"""The switch-cost contract (issue 19): a real cold engine's heartbeat, after real switches, teaches the router
its activation costs. Before the fix the engine reported ``full_staged``/``partial``/``host_only`` keys and
the router read ``resident``/``staged``/``open`` ones, so its costs never left the config defaults."""

from __future__ import annotations

import pytest

from services.engine.cold.engine import ColdEngine
from services.engine.service import EngineService
from services.router.gateway import Gateway
from services.router.leases import LeaseTable
from services.router.policy import PolicyParams, activation
from services.router.profiles import Defaults, ProfileBook
from services.router.registry import Registry
from services.router.sessions import SessionTable
from talaria.clock import WallClock
from talaria.config import EngineConfig, StackConfig
from talaria.switch_path import SwitchPath, costs_from_proto, costs_to_proto
from talaria.v1 import engine_pb2 as pb
from tests.unit.engine_fixtures import stage_fully

A, B = "tiny-llama", "tiny-qwen2"
# Defaults far from anything a tiny CPU switch measures, so a learned value cannot equal one by chance.
DEFAULTS = Defaults(switch_s=123.0, open_s=456.0)


def test_python_enum_mirrors_the_wire_enum():
    wire = {n.removeprefix("SWITCH_PATH_") for n in pb.SwitchPath.keys()} - {"UNSPECIFIED"}
    assert wire == {p.name for p in SwitchPath}
    for p in SwitchPath:
        assert SwitchPath.from_proto(p.proto) is p
    with pytest.raises(ValueError):
        SwitchPath.from_proto(pb.SWITCH_PATH_UNSPECIFIED)
    back = costs_from_proto(costs_to_proto({SwitchPath.PARTIAL: 0.25, SwitchPath.HOST_ONLY: 0.0}))
    assert back == {SwitchPath.PARTIAL: 0.25}  # unmeasured (0) paths are not sent


def test_router_learns_the_cold_engines_measured_switch_costs(synth_models):
    ce = ColdEngine({m: synth_models[m] for m in (A, B)}, page_size=4, kv_cache_bytes=40 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
    ce.switch_to(B)  # nothing staged: host-only
    stage_fully(ce, A)
    ce.switch_to(A)  # every chunk staged: device-to-device
    paths = [r.path for r in ce.switch_records]
    assert SwitchPath.HOST_ONLY in paths and SwitchPath.FULL_STAGED in paths, paths
    measured = ce.costs.by_path
    assert measured[SwitchPath.OPEN] > measured[SwitchPath.HOST_ONLY] > 0  # bank load + host-only switch

    cfg = EngineConfig(id="c0", pool="cold", models=[A, B])
    snap = EngineService(StackConfig(), cfg, ce).snapshot()  # the heartbeat the service publishes

    reg = Registry(WallClock(), miss_limit=3, stale_after=2, wall=WallClock().now)
    gw = Gateway(PolicyParams(), reg, SessionTable(WallClock()), LeaseTable(), WallClock().now, profiles=ProfileBook(DEFAULTS, alpha=1.0))
    assert gw.on_snapshot(pb.InstanceSnapshot.FromString(snap.SerializeToString()))
    prof = gw.profiles.profile("c0")
    assert prof.switch_s == pytest.approx(measured[SwitchPath.HOST_ONLY])
    assert prof.staged_switch_s == pytest.approx(measured[SwitchPath.FULL_STAGED])
    assert prof.open_s == pytest.approx(measured[SwitchPath.OPEN])

    # Eq. 1's activation term now prices the models the cold engine reports with those measurements
    inst = gw.state_for(gw.request("s", B, 8, 4))[0].instances[0]
    assert activation(inst, A) == ("active", 0.0)
    res_b = inst.models[B]
    want = prof.staged_switch_s if res_b.staged else prof.switch_s
    # B has no call and no session KV there: outside the rotation, a call of it joins it (Eq. 2 gates a join)
    assert not res_b.in_rotation
    assert activation(inst, B) == ("join", pytest.approx(want))
    assert activation(inst, B, rotation_eq2=False) == ("switch", pytest.approx(want))


def test_policy_params_and_priors_come_from_the_config_by_field_name():
    from dataclasses import fields

    from talaria.config import PlacementConfig

    pc = PlacementConfig(
        policy="least-pressure", admission_unit=2.0, admission_budget_s=7.0, hbm_reserve_fraction=0.1, running_weight=0.7,
        control_window_s=3.0, hbm_price_s_per_gib=0.2, replica_penalty_s=4.0, model_weights_gib={"m": 2.5},
        replica_shortlist=3, retry_after_s=9.0, default_prefill_per_token_s=1e-3, default_decode_step_s=0.05,
        default_restore_per_token_s=1e-5, default_switch_s=0.7, default_open_s=8.0,
    )
    p = PolicyParams.from_config(pc)
    for f in fields(PolicyParams):
        if hasattr(pc, f.name):
            assert getattr(p, f.name) == getattr(pc, f.name), f.name
    assert p.default_weights_gib == PolicyParams().default_weights_gib  # not a config knob
    assert Defaults.from_config(pc) == Defaults(1e-3, 0.05, 1e-5, 0.7, 8.0)
