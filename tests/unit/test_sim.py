"""The simulator (sim): profiles, the replay of recorded policy inputs into fresh policy objects
(the simulated router and slot scheduler decide exactly as the real ones), ablation behaviour and the
``summary.json`` contract of ``talaria sim paper``. Small virtual-clock runs only (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.engine.slots import CostModel, SlotScheduler
from services.router.gateway import Gateway, PoolSpec
from services.router.lease_service import LeaseService
from services.router.leases import LeaseTable, MemoryLeases
from services.router.profiles import Defaults, DemandMeter, ProfileBook, ShapeBook
from services.router.registry import Registry
from services.router.sessions import SessionTable
from talaria.clock import ManualClock
from sim import paper, report
from sim.cluster import SimConfig, SimSession, Simulation
from sim.instance import SimCall
from sim.profile import ProfileError, from_dict, load, uncited
from talaria.v1 import engine_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
TP8 = ROOT / "profiles" / "paper-tp8.yaml"
TP4 = ROOT / "profiles" / "paper-tp4-router.yaml"
ONE_GPU = ROOT / "profiles" / "one-gpu-14b.yaml"
MODELS = paper.ROUTER_MODELS


def sessions(n: int = 9, calls: int = 4, start_gap: float = 0.3, models=MODELS) -> list[SimSession]:
    """Growing prompts (each call extends the previous one), short outputs, sub-second tool gaps."""
    out = []
    for i in range(n):
        sid = f"s{i}"
        cs, prompt = [], 0
        for k in range(calls):
            prefix = prompt
            prompt = prompt + 2000 + 500 * ((i + k) % 3)
            cs.append(SimCall("", sid, k, models[i % len(models)], prompt, prefix, 8 + (i * 7 + k) % 13, 0.0 if k == 0 else 0.2 + 0.1 * (k % 3)))
        out.append(SimSession(sid, i * start_gap, cs))
    return out


# ------------------------------------------------------------------------------------------ profiles
@pytest.mark.parametrize("path", [TP8, TP4, ONE_GPU])
def test_paper_profiles_cite_every_number(path):
    raw = yaml.safe_load(path.read_text())
    assert uncited(raw) == []
    load(path)


def test_uncited_finds_a_bare_number():
    assert uncited({"a": {"value": 1, "cite": "§2"}, "b": 2, "c": {"value": 3, "cite": " "}}) == ["b", "c"]


def test_paper_profile_reproduces_published_points():
    p = load(TP8)
    m = p.model("qwen3-235b")
    assert m.prefill_s(0, 25_000) == pytest.approx(4.3, rel=1e-6)  # §2.1
    assert m.prefill_s(0, 100_000) == pytest.approx(10.9, rel=1e-6)  # §2.1
    assert p.switch.total(1.0) == pytest.approx(0.106, abs=1e-6)  # §5.6 full D2D p50
    assert p.switch.total(0.0) == pytest.approx(1.497, abs=1e-6)  # §5.6 H2D-only p50
    assert m.prefill_s(10_000, 5_000) == pytest.approx(m.prefill_s(0, 15_000) - m.prefill_s(0, 10_000))


def test_profile_rejects_bad_input():
    raw = yaml.safe_load(TP8.read_text())
    with pytest.raises(ProfileError):
        from_dict({**raw, "format": "other"})
    bad = dict(raw)
    bad["models"] = {"x": {"nonsense": 1}}
    with pytest.raises(ProfileError, match="unknown fields"):
        from_dict(bad)


# ------------------------------------------------------------------------- same decisions as real ones
def _two_workers(record: bool, policy: str = "full") -> SimConfig:
    from dataclasses import replace

    return replace(paper.router_config(load(TP4), policy), record=record)


def _fresh_gateway(sim: Simulation, clock: ManualClock) -> tuple[Gateway, MemoryLeases]:
    cfg = sim.cfg
    table = LeaseTable()
    d = sim.gateway.profiles.defaults
    gw = Gateway(cfg.params, Registry(clock, miss_limit=3.0, stale_after=2.0, wall=clock.now), SessionTable(clock), table, clock.now,
                 profiles=ProfileBook(Defaults(d.prefill_per_token, d.decode_step, d.restore_per_token, d.switch_s, d.open_s)),
                 shapes=ShapeBook(), demand=DemandMeter(), tau_s=cfg.tau_s,
                 pools={s.iid: PoolSpec(s.pool, s.catalog, cfg.profile.page_tokens) for s in cfg.instances})
    return gw, MemoryLeases(table)


def test_router_decisions_replay_identically_into_a_fresh_gateway():
    sim = Simulation(_two_workers(record=True), sessions())
    res = sim.run()
    trace = res.trace["router"]
    places = [e for e in trace if "place" in e]
    assert len(places) >= 36
    assert {e["decision"].reason for e in places} >= {"cost", "lease"}  # both paths of Algorithm 1 exercised
    clock = ManualClock()
    gw, leases = _fresh_gateway(sim, clock)
    ls = LeaseService(gw, leases)  # the router's lease settlement, as the simulator's
    same = 0
    for e in trace:
        clock.advance(e["t"] - clock.now())
        if "snapshot" in e:
            gw.on_snapshot(pb.InstanceSnapshot.FromString(e["snapshot"]))
        elif "hook" in e:
            lease = ls.on_hook(pb.CompletionHook.FromString(e["hook"]))
            assert (lease is not None) == e["lease"]
            if lease is not None:
                leases.install_now(lease)
        elif "arrival" in e:
            ls.arrival(e["arrival"])
        else:
            req = e["place"]
            d, rev = gw.decide(req)
            assert ls.settle_now(d, rev, req.session_id, req.model).stands
            assert d == e["decision"]
            same += 1
            if d.instance_id is not None:
                ls.commit(req, d)
    assert same == len(places)
    assert gw.stats["avoidable_cold_opens"] == res.router["avoidable_cold_opens"]


def _unscored(d):
    """A decision without the per-token deadline scoring of a closed round (the tracker's bookkeeping of
    emitted tokens, which the round scheduler only reports and the slot trace does not record)."""
    from dataclasses import replace

    return d if d.closed_round is None else replace(d, closed_round=replace(d.closed_round, deadlines=None))


def test_slot_decisions_replay_identically_into_a_fresh_scheduler():
    sim = Simulation(_two_workers(record=True), sessions())
    sim.run()
    checked = 0
    for iid, inst in sim.instances.items():
        fresh = SlotScheduler(inst.policy, CostModel(inst.seed_costs))
        for ev in sim._trace["slots"][iid]:
            if ev[0] == "decide":
                _, now, view, d = ev
                assert fresh.decide(view, now) == _unscored(d)
                checked += 1
            elif ev[0] == "switch":
                fresh.observe_switch(ev[1], ev[2])
            else:
                fresh.observe_step(*ev[1:])
    assert checked > 100


def test_replay_detects_a_diverging_scheduler():
    """The replay check can fail: a scheduler that is not told what steps cost decides differently."""
    sim = Simulation(paper.tp8_config(load(TP8), "Talaria", {}, record=True), sessions(6, 4, models=paper.TP8_MODELS))
    sim.run()
    inst = sim.instances["tp8-0"]
    fresh = SlotScheduler(inst.policy, CostModel(inst.seed_costs))
    diverged = False
    for ev in sim._trace["slots"]["tp8-0"]:
        if ev[0] == "decide":
            diverged |= fresh.decide(ev[2], ev[1]) != _unscored(ev[3])
        elif ev[0] == "switch":
            fresh.observe_switch(ev[1], ev[2])  # step measurements withheld
    assert diverged


# --------------------------------------------------------------------------------- ablation behaviour
def _tp8(name: str):
    cfg = paper.tp8_config(load(TP8), name, paper.CONFIGS[name])
    return report.summarize(Simulation(cfg, sessions(9, 4, models=paper.TP8_MODELS)).run())


def test_ablations_change_what_the_mechanisms_allow():
    tal, round_only, no_hkvr, h2d = _tp8("Talaria"), _tp8("Round-only"), _tp8("no-HKVR"), _tp8("H2D-only")
    for s in (tal, round_only, no_hkvr, h2d):
        assert s["calls"] == 36 and s["sessions"] == 9
    assert tal["kv_hits"]["host"] > 0
    assert round_only["kv_hits"]["host"] == 0 and round_only["kv_hits"]["recompute"] > 0 and round_only["sp_admitted"] == 0
    assert no_hkvr["kv_hits"]["host"] == 0
    assert set(h2d["switch_paths"]) == {"host_only"} and set(round_only["switch_paths"]) == {"host_only"}
    assert "full_staged" in tal["switch_paths"]
    assert round_only["sct_p50_s"] > tal["sct_p50_s"]


def test_router_policies_differ_on_avoidable_opens():
    full = report.summarize(Simulation(_two_workers(False, "full"), sessions()).run())
    lp = report.summarize(Simulation(_two_workers(False, "least-pressure"), sessions()).run())
    assert full["router"]["lease_hits"] > 0 and lp["router"]["lease_hits"] == 0
    assert full["avoidable_opens"] <= lp["avoidable_opens"]


# ------------------------------------------------------------------------------- summary.json contract
def test_sim_paper_writes_the_summary_contract(tmp_path, monkeypatch):
    from sim import workload

    monkeypatch.setattr(workload, "paper_replay", lambda models, **kw: sessions(6, 3, models=models))
    monkeypatch.setattr(workload, "router_subset", lambda models, **kw: sessions(6, 3, models=models))
    s = paper.run_paper(tmp_path, tp8_profile=str(TP8), router_profile=str(TP4), taus=(0.0, 1.0), say=lambda m: None, router_seeds=2)
    got = json.loads((tmp_path / "summary.json").read_text())
    # the router experiment's repetitions: every router beside least-pressure, paired per seed
    reps = got["router_repetitions"]
    assert set(reps) == {"least-pressure", "full", "session-sticky"} and got["assumptions"]["router_seeds"] == 2
    assert reps["least-pressure"]["baseline_ttft_p95_over_this"] == 1.0 and reps["full"]["seeds"] == 2
    assert reps["full"]["ttft_p95_s"] > 0 and "baseline_median_over_this_median" in reps["full"]
    assert set(got["tp8"]) == {"Talaria", "no-SP", "no-HKVR", "H2D-only", "no-hold", "Round-only"}
    for v in got["tp8"].values():
        assert set(v) == {"sct_p50_s", "sct_p95_s", "ttft_p95_s"} and v["sct_p50_s"] > 0
    assert {"full", "least-pressure"} <= set(got["router"])
    for v in got["router"].values():
        assert set(v) == {"avoidable_opens", "avoidable_opens_worker", "ttft_p95_s"}
    assert got["paper"]["tp8"]["Round-only"]["sct_p50_s"] == 1000.0 and got["paper"]["router"]["least-pressure"]["avoidable_opens"] == 37
    assert set(got["tau_sweep"]) == {"0.0", "1.0"}
    assert got["comparison"]["of"] >= 10
    assert (tmp_path / "tp8" / "sct_cdf.png").exists() and (tmp_path / "router" / "report.md").exists()
    assert s["tp8"] == got["tp8"]
    # the router testbed's two unpublished parameters are in the summary, at their calibrated defaults
    assert got["assumptions"]["router_start_gap_s"] == paper.ROUTER_START_GAP_S
    assert got["assumptions"]["router_open_h2d_s"] == paper.ROUTER_OPEN_H2D_S != load(TP4).switch.open_h2d_s


def test_the_router_testbeds_switch_from_host_is_set_or_left_as_the_profile_has_it():
    from sim.cli import _open_s

    prof = load(TP4)
    assert paper.testbed_profile(prof, 1.46).switch.open_h2d_s == 1.46
    assert paper.testbed_profile(prof, 1.46).switch.open_d2d_s == prof.switch.open_d2d_s
    assert paper.testbed_profile(prof, None) is prof
    assert _open_s("profile") is None and _open_s("1.46") == 1.46


def test_parking_instance_resumes_parked_calls_with_their_context():
    """can_park (the paper's engine): long decodes are parked at slot ends and resume in a later slot of
    their model, restoring prompt + decoded tokens from host KV; every call still finishes, and a first token
    is never 'earned' twice."""
    from dataclasses import replace

    def long_outputs():
        ss = sessions(6, 3, models=paper.TP8_MODELS)
        for s in ss:
            for c in s.calls:
                c.output_tokens = 400  # ~6 s of decode at the profile's step: past a slot budget
        return ss

    cfg = replace(paper.tp8_config(load(TP8), "Talaria", {}), can_park=True, decode_quantum=4)
    res = Simulation(cfg, long_outputs()).run()
    assert res.instances["tp8-0"]["parked"] > 0
    assert all(c.finished_at is not None and c.decoded == c.output_tokens for c in res.calls)
    assert all(c.first_token_at <= c.finished_at for c in res.calls)
    drain = Simulation(replace(cfg, can_park=False), long_outputs()).run()
    assert drain.instances["tp8-0"]["parked"] == 0


def test_paper_replay_has_the_published_shape():
    """§5.1: 10 tasks x 3 models = 30 model-sessions, 960 calls, each task identical on every model; the
    depths follow the §2.1 distribution's shape (its p95/p50 = 49/11 sets the spread)."""
    from sim import workload

    d = workload.paper_depths()
    assert len(d) == 10 and sum(d) == 320 and d == sorted(d)
    assert 4.0 < d[-1] / d[4] < 6.0  # the deepest task vs the median one (49/11 = 4.5 in the published shape)
    ss = workload.paper_replay(paper.TP8_MODELS, start_gap_s=26.0, output_scale=0.1)
    assert len(ss) == 30 and sum(len(s.calls) for s in ss) == 960
    by_task: dict[str, list] = {}
    for s in ss:
        by_task.setdefault(s.session_id.split("/")[1], []).append([(c.prompt_tokens, c.prefix_tokens, c.output_tokens, c.gap_s) for c in s.calls])
    assert len(by_task) == 10 and all(v[0] == v[1] == v[2] for v in by_task.values())
    assert sorted(s.start_s for s in ss) == [26.0 * j for j in range(30)]
    for s in ss:  # every continuation extends its prompt (prefix <= previous prompt)
        for a, b in zip(s.calls, s.calls[1:]):
            assert b.prefix_tokens <= a.prompt_tokens < b.prompt_tokens or b.prefix_tokens < a.prompt_tokens


def test_scale_cluster_splits_hot_and_cold_and_runs(tmp_path):
    from sim.scale import cluster, run_scale

    specs, catalog, weights = cluster(20, 8)
    hot = [s for s in specs if s.pool == "hot"]
    assert len(specs) == 20 and hot and all(len(s.catalog) == 1 for s in hot)
    assert weights[0] > weights[-1] and hot[0].catalog[0] == catalog[0]
    import gc

    before = gc.get_threshold()
    s = run_scale(tmp_path, profile=str(TP8), instances=6, models=4, sessions=12, base_sessions=12, say=lambda m: None)
    assert s["calls"] > 12 and s["sim_s"] > 0 and s["decide_p99_us"] > 0 and s["policy_p99_us"] > 0 and s["snapshot_p99_us"] > 0
    assert s["decide_p50_us"] <= s["decide_p99_us"] <= s["decide_p999_us"] <= s["decide_max_us"]
    assert s["gc_thresholds"][0] == 50_000 and gc.get_threshold() == before  # the router's collector while it ran, then ours
    assert json.loads((tmp_path / "scale.json").read_text())["instances"] == 6


def test_catalog_per_model_load_grows_with_the_catalog_on_single_gpu_instances(tmp_path):
    from sim.scale import run_catalog

    rows = run_catalog(tmp_path, profile=str(ONE_GPU), instances=2, catalogs=(2, 4), sessions=2, rate_per_s=0.05, per_model=True,
                       hot_fraction=0.0, gpus_per_instance=1, say=lambda m: None)
    assert (rows["2"]["sessions"], rows["4"]["sessions"]) == (4, 8) and rows["4"]["rate_per_s"] == pytest.approx(0.2)
    for r in rows.values():
        assert r["calls"] > r["sessions"] and r["models_per_gpu_at_slo"] == r["models_at_slo"] / 2
    saved = json.loads((tmp_path / "catalog.json").read_text())
    assert saved["hot_fraction"] == 0.0 and saved["gpus_per_instance"] == 1


def test_sim_run_replays_a_talaria_replay_file(tmp_path, capsys):
    from bench.workloads import write_jsonl
    from bench.workloads.synthetic import SynthParams, generate
    from sim.cli import main

    w = generate(SynthParams(sessions=4, models=("qwen3-235b", "glm5-nvfp4"), seed=1, max_depth=4))
    write_jsonl(w, tmp_path / "w.jsonl")
    assert main(["sim", "run", "--workload", str(tmp_path / "w.jsonl"), "--profile", str(TP8), "--configs", "Talaria,Round-only",
                 "--out", str(tmp_path / "out"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["Talaria", "Round-only"]
    assert all(r["calls"] == w.num_calls for r in rows)
    assert rows[1]["sct_p50_vs_base"] == 1.0 and (tmp_path / "out" / "report.md").exists()


def test_dynamic_pool_sizer_moves_instances_and_every_call_finishes(tmp_path):
    """The pool sizer (services/router/pool_sizing.py) driven from the simulated router's telemetry: on a
    drifting catalog it moves idle instances between pools; calls placed on a moving instance are retried."""
    from sim.scale import run_catalog, run_pools

    rows = run_pools(tmp_path, profile=str(TP8), instances=12, models=6, sessions=40, splits=(0.5,), rate_per_s=2.0, say=lambda m: None)
    assert set(rows) == {"static-0.5", "dynamic"}
    assert rows["static-0.5"]["moves"] == 0 and rows["dynamic"]["moves"] > 0
    assert json.loads((tmp_path / "pools.json").read_text())["rows"]["dynamic"]["moves"] == rows["dynamic"]["moves"]
    cat = run_catalog(tmp_path, profile=str(TP8), instances=6, catalogs=(3, 12), sessions=20, rate_per_s=2.0, say=lambda m: None)
    assert set(cat) == {"3", "12"} and all(0 <= r["models_at_slo"] <= r["models_requested"] for r in cat.values())


# ----------------------------------------------------------------------------- token deadlines (issue 16)
def test_token_deadlines_drive_a_cold_instance_with_the_engines_scheduler():
    """``token_deadlines`` makes a simulated cold instance run the engine's DeadlineScheduler (EDF at token
    boundaries), fed the same arrivals and tokens; every call finishes, its epochs land in the round
    summaries, and the run reports per-token deadline attainment (scored in round mode too)."""
    from services.engine.slots.deadlines import DeadlineScheduler

    cfg = paper.tp8_config(load(TP8), "token-deadlines", paper.config_flags("token-deadlines"), decode_quantum=4)
    sim = Simulation(cfg, sessions(9, 4, models=paper.TP8_MODELS))
    assert isinstance(sim.instances["tp8-0"].scheduler, DeadlineScheduler)
    res = sim.run()
    assert all(c.finished_at is not None and c.decoded == c.output_tokens for c in res.calls)
    s = report.summarize(res)
    assert s["rounds"] > 0 and all(rs.flags.get("token_deadlines") for _, rs in res.rounds)
    assert s["switches"] > 0 and sum(rs.wall_s for _, rs in res.rounds) > 0
    dl = res.instances["tp8-0"]["deadlines"]
    assert dl["first_tokens"] == 36 and dl["tokens"] == sum(c.output_tokens - 1 for c in res.calls)
    assert 0.0 < s["deadline_attainment"] <= 1.0 and 0.0 <= s["ttft_deadline_attainment"] <= 1.0
    tal = _tp8("Talaria")  # rounds: the same tokens are scored against the same deadlines
    assert tal["deadline_attainment"] <= 1.0 and tal["ttft_deadline_attainment"] < 1.0
    with pytest.raises(ValueError, match="unknown configuration"):
        paper.config_flags("tokens")


def test_coarsened_decode_emits_each_token_at_its_own_step_end():
    """A decode quantum of k tokens per scheduler decision still scores k tokens one decode step apart
    (the inter-token gaps are decode steps, not zeros with one long gap)."""
    from dataclasses import replace

    prof = load(TP8)
    cfg = replace(paper.tp8_config(prof, "Talaria", {}), decode_quantum=4)
    one = [SimSession("s0", 0.0, [SimCall("", "s0", 0, paper.TP8_MODELS[0], 2000, 0, 9, 0.0)])]
    res = Simulation(cfg, one).run()
    dl = res.instances["tp8-0"]["deadlines"]
    step = prof.model(paper.TP8_MODELS[0]).decode_s(1, 2000)
    assert dl["tokens"] == 8 and dl["gap_max_s"] <= 1.5 * prof.model(paper.TP8_MODELS[0]).decode_s(1, 2010)
    assert dl["gap_p50_s"] >= 0.5 * step  # not 0: the four tokens of a quantum are spread over its steps


# ------------------------------------------------------------------------------------------ streaming hot-swap
def _streaming_instance(prof, prefix: int = 0, host: bool = True):
    """A cold TP=8 instance with ``partial_layers``, model 0 active, one call of model 1 waiting (a return
    with ``prefix`` tokens of context; checkpointed to host KV when ``host``), nothing staged."""
    from services.kvstore.registry import HostKVRegistry
    from sim.instance import SimInstance
    from sim.profile import GIB

    reg = HostKVRegistry(int(prof.host_kv_gib * GIB), Simulation._slab(prof), clock=lambda: 0.0)
    inst = SimInstance("i", "cold", list(paper.TP8_MODELS), prof, paper.slot_policy(prof, d2d_staging=False), host=reg, partial_layers=True)
    m = paper.TP8_MODELS[1]
    if prefix and host:
        inst._checkpoint(SimCall("old", "s", 0, m, prefix, 0, 1, 0.0))
    c = SimCall("r", "s", 1, m, prefix + 3000, prefix, 4, 0.3)
    assert inst.submit(c, 0.0)
    return inst, c


def test_streamed_switch_copies_a_startup_prefix_and_no_group_runs_before_its_copy():
    """``partial_layers``: phase 2 copies only k* of the G groups host-to-device (k* from the engine's
    ``startup_prefix`` on the copy time per group and the compute the waiting call will do); the later groups
    stream from the switch's end, and the first forward cannot end before the last group landed plus that
    group's compute; the next step finds the model resident."""
    from services.engine.streaming_swap import startup_prefix

    prof = load(TP8)
    inst, c = _streaming_instance(prof, prefix=20480)  # a return: restores 20K tokens, computes 3K
    g = inst.groups
    assert g == prof.knobs["layer_groups"] == 94
    _, secs, phases = inst.switch(c.model, 10.0)
    copy = prof.switch.open_h2d_s / g
    fwd = inst.scheduler.costs.prefill_per_token(c.model) * 3000
    k = startup_prefix([copy] * g, [fwd / g] * g)
    assert 1 <= k < g and inst.startup_k == [k]
    assert phases[1] == pytest.approx(k / g * prof.switch.open_h2d_s)
    assert secs < prof.switch.total(0.0)
    end = 10.0 + secs
    assert len(inst.stream) == g - k and inst.stream[-1] == pytest.approx(end + (g - k) * copy)
    inst.admit((c.request_id,), end)
    assert c.restore_left == 20480
    restore = 20480 * prof.model(c.model).restore_per_token_s
    compute = prof.model(c.model).prefill_s(20480, 3000)  # cheaper per token than the estimate: the forward catches up with the copies
    out = inst.step(end)
    assert out.seconds >= restore + (g - k) * copy + compute / g - 1e-9  # the last group ran only after its copy (the restore took the channel first)
    assert inst.stream_stall_s > 0 and out.seconds == pytest.approx(restore + compute + inst.stream_stall_s)
    assert inst.stream == [] and inst.streams == 1
    assert inst.step(end + out.seconds).seconds == pytest.approx(prof.model(c.model).decode_s(1, c.prompt_tokens + 1))  # resident: no stall


def test_startup_prefix_counts_only_what_the_first_forward_computes():
    """A return whose prefix the host KV store holds computes only its new suffix, so its k* is longer
    than the same prompt's without a host copy (counting the whole context made k* too short and stalled
    the first forward: the engine's ``SlotSwitching.first_prefill_tokens`` and the simulator agree)."""
    prof = load(TP8)
    lost, c1 = _streaming_instance(prof, prefix=20480, host=False)
    ret, c2 = _streaming_instance(prof, prefix=20480)
    lost.switch(c1.model, 0.0)
    ret.switch(c2.model, 0.0)
    assert ret.startup_k[0] > lost.startup_k[0]


def test_partial_layers_row_streams_switches_and_the_base_row_does_not():
    """The ``partial-layers`` configuration (an engine flag, not a slot-policy flag) streams switches on the
    TP=8 replay; every call finishes; Talaria's row streams none."""
    assert paper.config_flags("partial-layers") == {} and paper.engine_flags("partial-layers") == {"partial_layers": True}
    prof = load(TP8)
    rows = {}
    for name in ("Talaria", "partial-layers"):
        cfg = paper.tp8_config(prof, name, paper.config_flags(name), decode_quantum=4, **paper.engine_flags(name))
        res = Simulation(cfg, sessions(9, 4, models=paper.TP8_MODELS)).run()
        assert all(c.finished_at is not None for c in res.calls)
        rows[name] = report.summarize(res)
    assert rows["Talaria"]["streams"] == 0 and rows["partial-layers"]["streams"] > 0
    assert 0 < rows["partial-layers"]["startup_share"] < 1


# ------------------------------------------------------------------------------------------ unified residency
def _unified_instance(prof, partial: bool = False):
    """A cold TP=8 instance with ``unified_residency``: model 0 active, one call of each other model waiting."""
    from sim.instance import SimInstance

    inst = SimInstance("i", "cold", list(paper.TP8_MODELS), prof, paper.slot_policy(prof), host=None, unified_residency=True, partial_layers=partial)
    for j, m in enumerate(paper.TP8_MODELS[1:]):
        assert inst.submit(SimCall(f"r{j}", f"s{j}", 0, m, 4000, 0, 4, 0.0), 0.0)
    return inst


def test_unified_residency_stages_every_waiting_model_within_the_budget():
    """The engine's ResidencyManager plans the simulated instance's staging: both inactive models with waiting
    calls get staged (``predict_next`` alone stages one), the staged bytes never exceed the KV region's free
    bytes, and a model that becomes active leaves the staged set."""
    from sim.instance import SimInstance

    prof = load(TP8)
    inst = _unified_instance(prof)
    inst.restage(0.0)
    a, b = paper.TP8_MODELS[1:]
    assert inst.residency.plan is not None and inst.residency.plan.target_bytes <= inst.residency.plan.budget_bytes
    t = 3 * prof.switch.open_h2d_s  # time enough to copy both at the H2D rate
    assert inst.staged_fraction(a, t) == pytest.approx(1.0) and inst.staged_fraction(b, t) == pytest.approx(1.0)
    assert sum(inst.residency.staged.values()) <= inst.kv_free_bytes()
    path, secs, _ = inst.switch(a, t)
    assert path == "full_staged" and secs == pytest.approx(prof.switch.total(1.0))
    assert a not in inst.residency.staged and inst.residency.staged[b] > 0
    base = SimInstance("j", "cold", list(paper.TP8_MODELS), prof, paper.slot_policy(prof), host=None)
    for j, m in enumerate(paper.TP8_MODELS[1:]):
        base.submit(SimCall(f"r{j}", f"s{j}", 0, m, 4000, 0, 4, 0.0), 0.0)
    base.restage(0.0)
    assert sum(1 for m in (a, b) if base.staged_fraction(m, t) > 0) == 1  # predict_next: one target


def test_unified_residency_with_streaming_keeps_only_startup_prefixes_and_yields_to_kv():
    """With streaming hot-swap only a model's startup prefix has a recovery cost, so the plan stages no
    more than k* groups of it; in a region too small for everything, KV comes first: the staged bytes shrink
    when the batch's KV grows, and a session prefix worth less than the weights is released."""
    from dataclasses import replace

    prof = load(TP8)
    inst = _unified_instance(prof, partial=True)
    inst.restage(0.0)
    t = 3 * prof.switch.open_h2d_s
    for m in paper.TP8_MODELS[1:]:
        k = inst.residency.plan.weight_prefix(m)
        assert 0 < k < inst.groups and inst.staged_fraction(m, t) == pytest.approx(k / inst.groups)
    # a small region: the active model's weights leave room for ~1.3 M tokens of KV
    small = replace(prof, hbm_gib=(prof.model(paper.TP8_MODELS[0]).weights_gib + 240) / prof.arena_fraction)
    inst = _unified_instance(small)
    m0 = paper.TP8_MODELS[0]
    old = SimCall("o", "cold-session", 0, m0, 400_000, 0, 1, 0.0)
    inst.keep(old, -600.0)  # a session cached on the device, last used long ago: low return probability
    assert "cold-session" in inst.device
    inst.restage(0.0)
    assert "cold-session" not in inst.device and inst.residency.released_sessions == 1
    inst.residency.advance(inst, 100.0)
    staged = sum(inst.residency.staged.values())
    assert staged > 0
    big = SimCall("b", "busy", 0, m0, 600_000, 0, 64, 0.0)  # a running call's KV takes most of the region
    inst.batch.append(big)
    inst.residency.advance(inst, 100.0)
    assert sum(inst.residency.staged.values()) <= inst.kv_free_bytes() < staged


def test_cpu_profile_charges_host_kv_checkpoints_to_the_next_step():
    """A CPU profile's ``checkpoint_per_token_s`` (the copies of a checkpoint run on the serving cores) lands
    on the instance's next step; a GPU profile has none (asynchronous D2H DMA) and the field defaults to 0."""
    from dataclasses import replace

    from services.kvstore.registry import HostKVRegistry
    from sim.instance import SimInstance

    prof = load(TP8)
    m = paper.TP8_MODELS[0]
    assert prof.model(m).checkpoint_per_token_s == 0.0
    cpu = replace(prof, default=replace(prof.default, checkpoint_per_token_s=1e-5), models={})
    steps = []
    for p in (prof, cpu):
        reg = HostKVRegistry(int(p.host_kv_gib * 2**30), Simulation._slab(p), clock=lambda: 0.0)
        inst = SimInstance("i", "cold", list(paper.TP8_MODELS), p, paper.slot_policy(p), host=reg)
        done = SimCall("d", "s", 0, m, 4000, 0, 1, 0.0)
        done.decoded = 1
        inst.keep(done, 0.0)  # a call ended: checkpointed
        nxt = SimCall("n", "t", 0, m, 2000, 0, 2, 0.0)
        inst.submit(nxt, 0.0)
        inst.admit(("n",), 0.0)
        steps.append((inst.step(0.0).seconds, inst.step(1.0).seconds))
    assert steps[1][0] == pytest.approx(steps[0][0] + 4001 * 1e-5)  # charged once, to the next step
    assert steps[1][1] == pytest.approx(steps[0][1])


def test_sim_validate_compares_a_matrix_run_with_each_profile(tmp_path, capsys):
    """``talaria sim validate`` (issue 15): medians over the matrix's repetitions against the simulation of the
    same workload; errors, the 20 % verdict and the ordering; configurations it cannot simulate, or that
    failed a repetition, are left out; exit 1 when a profile misses."""
    from bench.workloads import write_jsonl
    from bench.workloads.synthetic import SynthParams, generate
    from sim.cli import main
    from sim.validate import compare, simulate

    w = generate(SynthParams(sessions=6, models=("qwen3-235b", "glm5-nvfp4"), seed=2, max_depth=8))
    mdir = tmp_path / "matrix"
    mdir.mkdir()
    write_jsonl(w, mdir / "workload.jsonl")
    sim = simulate(mdir / "workload.jsonl", str(TP8), ["Talaria", "Round-only"], 2)
    assert sim["Talaria"]["sct_p50_s"] < sim["Round-only"]["sct_p50_s"]

    def matrix(scale: dict[str, float]) -> None:
        reps = []
        for rep in (1, 2, 3):  # medians over repetitions: the middle one is exactly sim x scale
            f = {1: 0.9, 2: 1.0, 3: 1.2}[rep]
            reps += [{"rep": rep, "name": c, "status": "ok", "sct_p50_s": sim[c]["sct_p50_s"] * scale[c] * f,
                      "sct_p95_s": sim[c]["sct_p95_s"] * scale[c] * f} for c in sim]
            reps.append({"rep": rep, "name": "least-pressure", "status": "ok", "sct_p50_s": 1.0, "sct_p95_s": 2.0})
            reps.append({"rep": rep, "name": "no-SP", "status": "ok" if rep != 2 else "failed: boom", "sct_p50_s": 1.0, "sct_p95_s": 2.0})
        summ = {"meta": {"workload_file": str(tmp_path / "elsewhere.jsonl")}, "rows": [{"name": r["name"]} for r in reps[:4]], "repetitions": reps}
        (mdir / "summary.json").write_text(json.dumps(summ))

    matrix({"Talaria": 1.05, "Round-only": 1.15})  # the simulation 5 % fast on Talaria, 13 % on Round-only
    assert main(["sim", "validate", "--matrix", str(mdir), "--profiles", str(TP8), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert list(r["real"]) == ["Talaria", "Round-only"] and r["skipped"] == ["least-pressure"]  # no-SP failed a repetition
    v = r["profiles"][str(TP8)]
    assert abs(v["errors"]["Talaria"]["sct_p50_s"] - (1 / 1.05 - 1)) < 1e-9
    assert abs(v["errors"]["Round-only"]["sct_p95_s"] - (1 / 1.15 - 1)) < 1e-9
    assert v["within"] and r["within_all"] and r["same_order_all"] and r["instances"] == 2

    matrix({"Talaria": 1.3, "Round-only": 1.3})  # 23 % off, same order: outside 20 %
    assert main(["sim", "validate", "--matrix", str(mdir), "--profiles", str(TP8)]) == 1
    assert "NOT within 20%" in capsys.readouterr().out

    real = {"A": {"sct_p50_s": 1.0, "sct_p95_s": 2.0}, "B": {"sct_p50_s": 2.0, "sct_p95_s": 3.0}}
    flipped = {"A": {"sct_p50_s": 2.1, "sct_p95_s": 2.0}, "B": {"sct_p50_s": 2.0, "sct_p95_s": 3.0}}
    c = compare(real, flipped)
    assert c["same_order"] == {"sct_p50_s": False, "sct_p95_s": True} and not c["within"]
    assert compare(real, flipped, resolved={"sct_p50_s": [], "sct_p95_s": [("A", "B")]})["same_order"]["sct_p50_s"]  # a tie of the real run

    # a pair that swapped between the real repetitions is a tie: the simulation may order it either way
    summ = json.loads((mdir / "summary.json").read_text())
    for r in summ["repetitions"]:
        if r["name"] == "Talaria" and r["rep"] == 3:
            r["sct_p50_s"] = 100.0  # slower than Round-only in this repetition only (the median stays)
    (mdir / "summary.json").write_text(json.dumps(summ))
    assert main(["sim", "validate", "--matrix", str(mdir), "--profiles", str(TP8), "--tolerance", "0.5", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["profiles"][str(TP8)]
    assert v["resolved"]["sct_p50_s"] == [] and v["resolved"]["sct_p95_s"] == [["Talaria", "Round-only"]]
    assert main(["sim", "validate", "--matrix", str(mdir), "--profiles", str(tmp_path / "none.yaml")]) == 2  # a clear error, no traceback
    assert main(["sim", "validate", "--matrix", str(mdir), "--profiles", str(TP8), "--configs", "least-pressure"]) == 2
    assert "does not model least-pressure" in capsys.readouterr().err


def test_sim_validate_orders_only_what_the_real_run_resolves(tmp_path):
    """A pair counts for the ordering check only when every repetition agrees and the medians are at least
    the resolution apart; closer or swapping pairs are ties of the real run."""
    from sim.validate import measured

    def rep(rep: int, name: str, p50: float, p95: float) -> dict:
        return {"rep": rep, "name": name, "status": "ok", "sct_p50_s": p50, "sct_p95_s": p95}

    reps = []
    for r in (1, 2, 3):
        reps += [rep(r, "A", 10.0 + r * 0.01, 20.0), rep(r, "B", 10.2 + r * 0.01, 30.0 - (r == 2) * 15.0), rep(r, "C", 12.0, 40.0)]
    (tmp_path / "summary.json").write_text(json.dumps({"meta": {}, "rows": [], "repetitions": reps}))
    real, resolved, _, instances = measured(tmp_path)
    assert instances == 2 and abs(real["B"]["sct_p50_s"] - 10.22) < 1e-9
    assert resolved["sct_p50_s"] == [("A", "C"), ("B", "C")]  # A < B in every repetition, but only 2 % apart
    assert resolved["sct_p95_s"] == [("A", "C"), ("B", "C")]  # A vs B swapped in repetition 2
    assert measured(tmp_path, resolution=0.0)[1]["sct_p50_s"] == [("A", "B"), ("A", "C"), ("B", "C")]


def test_router_sweep_pairs_each_variant_with_the_baseline_per_seed():
    prof = load("profiles/paper-tp4-router.yaml")
    rows = paper.router_sweep(prof, ["full", "full:lease_arithmetic=false"], [3.0], 2, say=lambda m: None)
    assert [r["router"] for r in rows] == ["least-pressure", "full", "full:lease_arithmetic=false"]
    base, full, plain = rows
    assert base["baseline_ttft_p95_over_this"] == 1.0 and base["seeds_won_ttft_p95"] == 0
    assert full["baseline_median_over_this_median"] == base["ttft_p95_s"] / full["ttft_p95_s"]  # ratio of the two medians
    assert full["avoidable_opens"] < base["avoidable_opens"]  # the router testbed's point, medians over two task orders
    assert plain["same_instance_returns"] > full["same_instance_returns"]  # leases honoured as Algorithm 1 does


def test_router_sweep_names_an_unknown_knob():
    with pytest.raises(ValueError, match="no field 'lease_magic'"):
        paper._variant("full:lease_magic=true")
