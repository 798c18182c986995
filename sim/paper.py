"""``talaria sim paper``: both of the paper's experiments under the simulator, against its numbers.

* TP=8 fixed replay (Talaria §5.1-5.2, §5.5-5.6): one cold TP=8 instance serving three >100B models, 30
  model-sessions / 960 calls (``workload.paper_tp8``), five configurations: Talaria, no-SP, no-HKVR,
  H2D-only, Round-only (the ablation switches of ``SlotPolicy``).
* Router experiment (§5.3-5.4): two cold TP=4 workers, 120 calls / 30 model-sessions at high load, router
  policies ``full`` and ``least-pressure`` (and ``session-sticky``), plus the tau sweep of §5.4.

Workload parameters not published, set here and stated in ``summary.json``: completion-token lengths (the
generator assumes p50 300; ``OUTPUT_SCALE`` shortens them), session start spacing (``TP8_START_GAP_S``) and
task order. The task depths follow the published depth distribution (``workload.paper_depths``).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.engine.slots import SlotPolicy
from services.router.policy import PolicyParams

from . import report, workload
from .cluster import InstanceSpec, SimConfig, Simulation
from .profile import Profile, load

TP8_MODELS = ("qwen3-235b", "glm5-nvfp4", "qwen3.5-122b-a10b")  # §5.1
ROUTER_MODELS = ("qwen3-32b", "qwen2.5-32b-instruct", "qwen3.5-35b-a3b")  # §5.1 (TP=4 router testbed)
CONFIGS = {  # §5.1: reverse ablations; Round-only = all three off
    "Talaria": {},
    "no-SP": {"sp": False},
    "no-HKVR": {"host_kv": False},
    "H2D-only": {"d2d_staging": False},
    "no-hold": {"return_hold": False},  # not in the paper: the slot hold for expected returns (slots/hold.py) off
    "Round-only": {"sp": False, "host_kv": False, "d2d_staging": False, "return_hold": False},
}
# not the paper's rows: run only when named (``talaria sim run --configs``, ``sim paper --configs``)
EXTRA_CONFIGS = {
    "SP-new-sessions": {"sp_new_sessions": True},  # SP also admits calls without a usable prefix mid-slot (slots/admission.py)
    "token-deadlines": {"token_deadlines": True},  # issue 16 (Aegaeon): EDF at token boundaries instead of rounds
    "token-deadlines-no-HKVR": {"token_deadlines": True, "host_kv": False},
    "partial-layers": {"partial_layers": True},  # issue 16 (JointServe §4.4): streaming hot-swap of later layer groups
    "partial-layers-H2D-only": {"partial_layers": True, "d2d_staging": False},
    "partial-layers+token-deadlines": {"partial_layers": True, "token_deadlines": True},
    "unified-residency": {"unified_residency": True},  # issue 16 (JointServe §3): one budget for staged weights and session KV
    "unified-residency+partial-layers": {"unified_residency": True, "partial_layers": True},
    "JointServe+Aegaeon": {"unified_residency": True, "partial_layers": True, "token_deadlines": True},
}
ENGINE_FLAGS = ("partial_layers", "unified_residency")  # mechanism flags: fields of SimConfig (the engine's config), not of SlotPolicy


def _flags(name: str) -> dict[str, bool]:
    flags = CONFIGS.get(name, EXTRA_CONFIGS.get(name))
    if flags is None:
        raise ValueError(f"unknown configuration {name!r}; known: {', '.join([*CONFIGS, *EXTRA_CONFIGS])}")
    return flags


def config_flags(name: str) -> dict[str, bool]:
    """The slot-policy flags of a named configuration (``CONFIGS`` or ``EXTRA_CONFIGS``); ValueError names the
    known ones."""
    return {k: v for k, v in _flags(name).items() if k not in ENGINE_FLAGS}


def engine_flags(name: str) -> dict[str, bool]:
    """The engine-mechanism flags of a named configuration (``SimConfig`` fields, e.g. ``partial_layers``)."""
    return {k: v for k, v in _flags(name).items() if k in ENGINE_FLAGS}
OUTPUT_SCALE = 0.1
TP8_START_GAP_S = 26.0  # not published: (1632 s of Talaria rounds, §5.6 - 867 s SCT p95) / 29 later starts
DECODE_QUANTUM = 4  # decode tokens per scheduler decision in the paper runs (4 x ~17 ms: SP boundaries ~70 ms apart)
# The router testbed's two unpublished parameters (sim/README.md, "The router testbed, calibrated"):
# "high load" (§5.3) is not published: the start gap at which least-pressure's TTFT p95 (median over seeds 0-9)
# is the paper's 8.07 s (7.77 s at 4.2 s; 10.0 s at 4 s, 6.7 s at 4.4 s). 2 s before 2026-12-07.
ROUTER_START_GAP_S = 4.2
# The TP=4 workers' switch from host (phase 2, H2D) is not published either: the paper's measured H2D-only
# switch (§5.6, 1.46 s at TP=8) instead of the profile's bandwidth-scaled 0.4 s (64 GB over 4 ranks at 40 GB/s),
# with which the full router's opens cost too little for the paper's result (3 vs 20 avoidable opens, TTFT p95
# 1.21x at 4 s). None: the profile's value.
ROUTER_OPEN_H2D_S: float | None = 1.46
TAUS = (0.0, 0.5, 1.0, 2.0, 5.0)  # §5.4
# The router experiment's repetitions: task orders (seeds 0..N-1) at the same load. One order is 120 calls, so one
# seed's TTFT p95 is its 7th-worst call (seed 0 alone: full 5.40 s vs least-pressure 7.40 s; over seeds 0-9 each
# router's median and the paired per-seed ratio are what the testbed says): summary.json "router_repetitions".
ROUTER_SEEDS = 10

PAPER: dict[str, Any] = {
    "tp8": {  # §5.2 (Fig. 6-7), §5.5 (Fig. 11), HKVR paragraph of §5.2
        "Talaria": {"sct_p50_s": 189.0, "sct_p95_s": 867.0, "ttft_p50_s": 0.55, "ttft_p95_s": 14.17},
        "no-SP": {"sct_p50_s": 623.0, "ttft_p50_s": 4.60, "ttft_p95_s": 20.5},
        "no-HKVR": {"sct_p50_s": 486.0, "ttft_p95_s": 26.33},
        "H2D-only": {"sct_p50_s": 194.0, "sct_p95_s": 933.0},
        "Round-only": {"sct_p50_s": 1000.0, "sct_p95_s": 2296.0, "ttft_p50_s": 13.44},
    },
    "tp8_ratios": {"sct_p50_round_only_over_talaria": 5.3, "sct_p95_round_only_over_talaria": 2.6},
    "switch": {"talaria_switch_share": 0.346, "h2d_only_switch_share": 0.517, "talaria_rounds": 200, "round_only_rounds": 339},
    "router": {  # §5.3, high load
        "full": {"avoidable_opens": 1, "ttft_p95_s": 5.28},
        "least-pressure": {"avoidable_opens": 37, "ttft_p95_s": 8.07},
        "session-sticky": {"avoidable_opens": 5, "ttft_p95_s": 6.23},
    },
    "tau_sweep": {  # §5.4
        "0.0": {"same_instance_return_rate": 0.562, "model_opens": 33, "returning_ttft_p50_s": 1.51, "returning_ttft_p95_s": 2.11},
        "1.0": {"same_instance_return_rate": 0.677, "model_opens": 47, "returning_ttft_p50_s": 0.99, "returning_ttft_p95_s": 1.91},
        "5.0": {"same_instance_return_rate": 0.792, "model_opens": 56},
    },
}


def slot_policy(profile: Profile, **flags: bool) -> SlotPolicy:
    k = profile.knobs
    fields = ("ttft_s", "tpot_s", "gamma", "sp_max_batch", "sp_max_tokens")
    return SlotPolicy(**{f: k[f] for f in fields if f in k}, **flags)


def tp8_config(profile: Profile, name: str, flags: dict[str, bool], record: bool = False, decode_quantum: int = 1,
               partial_layers: bool = False, unified_residency: bool = False) -> SimConfig:
    return SimConfig(name, profile, (InstanceSpec("tp8-0", "cold", TP8_MODELS),), slot=slot_policy(profile, **flags),
                     tau_s=float(profile.knobs.get("tau_s", 1.0)), record=record, decode_quantum=decode_quantum, partial_layers=partial_layers,
                     unified_residency=unified_residency)


def replay_summaries(profile: Profile, w, names: list[str], instances: int) -> list[dict[str, Any]]:
    """Each named configuration (``CONFIGS`` / ``EXTRA_CONFIGS``) simulated on the replay workload ``w``
    (``talaria-replay/1``) over ``instances`` cold instances serving all its models: the report summaries,
    in ``names`` order (``talaria sim run``, ``talaria sim validate``)."""
    specs = tuple(InstanceSpec(f"sim-{i}", "cold", tuple(w.models())) for i in range(instances))
    rows = []
    for name in names:
        cfg = SimConfig(name, profile, specs, slot=slot_policy(profile, **config_flags(name)), tau_s=float(profile.knobs.get("tau_s", 1.0)),
                        **engine_flags(name))
        rows.append(report.summarize(Simulation(cfg, workload.from_workload(w)).run()))  # fresh call objects per configuration
    return rows


def testbed_profile(profile: Profile, open_h2d_s: float | None = ROUTER_OPEN_H2D_S) -> Profile:
    """The router testbed's profile: ``profile`` with its switch from host (phase 2, H2D) at ``open_h2d_s``
    seconds (None: as the profile has it). Pure."""
    return profile if open_h2d_s is None else replace(profile, switch=replace(profile.switch, open_h2d_s=open_h2d_s))


def router_config(profile: Profile, policy: str, tau: float | None = None, park: bool = False) -> SimConfig:
    """The §5.3 testbed: two cold TP=4 workers, each starting with a different model on its device (the first and
    the last of ``ROUTER_MODELS``: one model is resident nowhere, as with 3 models on 2 one-model devices).
    ``max_loaded`` (profile knob) bounds each worker's rotation / weight bank (0: every catalog model); residency
    is the device's (``SimConfig.device_residency``, sim/README.md "Router testbed")."""
    k = profile.knobs
    ml = int(k.get("max_loaded", 0))
    first = (ROUTER_MODELS[0], ROUTER_MODELS[-1])
    loaded = [(f, *(m for m in ROUTER_MODELS if m != f))[: ml or None] for f in first]
    specs = tuple(InstanceSpec(f"tp4-{i}", "cold", ROUTER_MODELS, tuple(loaded[i]), ml) for i in range(2))
    gib = {m: profile.model(m).weights_gib for m in ROUTER_MODELS}
    return SimConfig(f"{policy}" if tau is None else f"tau={tau:g}", profile, specs, slot=slot_policy(profile),
                     params=PolicyParams(policy=policy, model_weights_gib=gib), tau_s=float(k.get("tau_s", 1.0)) if tau is None else tau,
                     can_park=park, device_residency=bool(k.get("device_residency", True)))


def run_tp8(profile: Profile, configs: list[str], seed: int, say, output_scale: float = OUTPUT_SCALE, start_gap_s: float = TP8_START_GAP_S,
            park: bool = False) -> list[dict[str, Any]]:
    rows = []
    for name in configs:
        sessions = workload.paper_replay(TP8_MODELS, seed=seed, output_scale=output_scale, start_gap_s=start_gap_s)
        cfg = tp8_config(profile, name, config_flags(name), decode_quantum=DECODE_QUANTUM, **engine_flags(name))
        r = Simulation(replace(cfg, can_park=park), sessions).run()
        s = report.summarize(r)
        say(f"tp8 {name:10s} SCT p50 {s['sct_p50_s']:.0f} s p95 {s['sct_p95_s']:.0f} s TTFT p95 {s['ttft_p95_s']:.2f} s ({r.wall_s:.0f} s wall)")
        rows.append(s)
    return rows


def run_router(profile: Profile, policies: list[str], seed: int, say, taus: tuple[float, ...] = TAUS, output_scale: float = OUTPUT_SCALE,
               park: bool = False, start_gap_s: float = ROUTER_START_GAP_S) -> tuple[list[dict], list[dict]]:
    rows, sweep = [], []
    for pol in policies:
        sessions = workload.router_subset(ROUTER_MODELS, seed=seed, output_scale=output_scale, start_gap_s=start_gap_s)
        s = report.summarize(Simulation(router_config(profile, pol, park=park), sessions).run())
        say(f"router {pol:15s} avoidable opens {s['avoidable_opens']} (on the workers' state {s['avoidable_opens_worker']}) TTFT p95 {s['ttft_p95_s']:.2f} s")
        rows.append(s)
    for tau in taus:
        sessions = workload.router_subset(ROUTER_MODELS, seed=seed, output_scale=output_scale, start_gap_s=start_gap_s)
        s = report.summarize(Simulation(router_config(profile, "full", tau, park=park), sessions).run())
        say(f"tau {tau:g}: same-instance returns {s['router']['same_instance_return_rate']} opens {s['router']['model_opens']}")
        sweep.append(s)
    return rows, sweep


NOTES = (  # the closing note: which assumptions differ from the paper's setting, and why they matter
    "Slots drain (D_fin), as the paper describes (§3.4: D_fin 'spends the remaining protected budget on in-flight decode "
    "before switching models'; §4.2: a switch releases the active kv_cache region). §5.5's '316 admitted, 345 parked' are SP "
    "handling events, the parked ones *deferred* (Fig. 10b: Admitted / Deferred), not in-flight calls parked at a switch. "
    "--park models an engine that parks in-flight calls (context to host KV, recomputed without it): it moves Talaria little "
    "(SCT p50/p95 326/812 s vs 319/792 s drained) and without host KV (no-HKVR, Round-only) parked calls recompute their "
    "context every slot and the run does not converge (76,000 simulated s after 5 min), which the paper's no-HKVR 486 s rules "
    "out. The paper's TTFT p50 0.55 s (half the calls start within 0.55 s) needs returns to find their model's slot still "
    "open; here a slot closes when its batch drains and a return 0.4 s later waits a round (TTFT p50 6.6 s).",
    "Recompute-bound configurations (no-HKVR, Round-only) cannot reach the paper's numbers with the §2.1 recompute cost and "
    "prompt lengths: ~910 of 960 calls recompute their prompt (p50 25K tokens, 4.3 s at the §2.1 point, more for longer "
    "prompts), >= 3900 s of prefill on one instance, while the paper's Round-only finishes its p95 session in 2296 s. So either "
    "the replay's Claude Code/Astropy prompts are shorter than the 445-session SWE-Bench characterisation, or the 4.3 s TTFT "
    "includes overhead that batched recompute does not pay (an affine fit through the two §2.1 points gives 2.1 s + 88 us/token). "
    "Neither is published; the profile keeps the §2.1 curve and these two configurations saturate.",
    "Workload (sim/workload.paper_replay): task depths are the §2.1 depth distribution's quantiles scaled to 320 calls "
    "(5..101, p50 ~22; the ratio 101/22 = 4.6 equals the paper's Talaria SCT p95/p50 867/189), prompts/gaps from the §2.1 "
    "distributions, 20/960 gaps at the 10 s cap (§5.1). Not published: completion lengths (generator p50 300 x output_scale "
    "0.1), session start spacing (26 s), task order (seeded).",
    "Unpublished costs: decode step 15 ms derived from §5.6 (1067 s of Talaria execution), restore bandwidth, T_TPOT, GLM5 "
    "size: profiles/paper-tp8.yaml.",
    "Router testbed: the paper's TP=4 worker costs are unpublished (profiles/paper-tp4-router.yaml is derived). "
    "A model is resident on a worker when its weights are on the device (active or being staged), as Eq. 1 and §5.4's "
    "open counts imply (opens = (1 - model-residency hit) x 120: ~40 % of calls find their model on neither device); an "
    "avoidable open is an open of a model the other worker has resident, counted by the router on its view "
    "(avoidable_opens) and on the workers' state (avoidable_opens_worker). Two parameters are not published and set here: "
    "the load of 'high load', calibrated as the start gap at which least-pressure's TTFT p95 (median over seeds 0-9) is "
    "the paper's 8.07 s (4.2 s: 7.77 s), and the switch from host, the paper's measured H2D-only switch (1.46 s, §5.6) "
    "instead of the bandwidth-scaled 0.4 s, with which opens cost too little for the paper's result "
    "(sim/README.md, 'The router testbed, calibrated').",
)


def _within(ours: float, paper: float, tol: float = 0.15) -> bool:
    return math.isfinite(ours) and paper > 0 and abs(ours - paper) / paper <= tol


def compare(tp8: dict[str, dict], router: dict[str, dict]) -> dict[str, Any]:
    """Per published number: ours, paper's, relative error, within 15 %; and the ablation ordering."""
    checks = []
    for sec, ours in (("tp8", tp8), ("router", router)):
        for name, nums in PAPER[sec].items():
            for k, v in nums.items():
                o = ours.get(name, {}).get(k)
                if o is None:
                    continue
                checks.append({"what": f"{sec}.{name}.{k}", "ours": o, "paper": v, "rel_err": (o - v) / v if v else None, "within_15pct": _within(o, v)})
    order_paper = sorted(PAPER["tp8"], key=lambda n: PAPER["tp8"][n]["sct_p50_s"])
    order_ours = sorted((n for n in order_paper if n in tp8), key=lambda n: tp8[n]["sct_p50_s"])
    return {"checks": checks, "within_15pct": sum(c["within_15pct"] for c in checks), "of": len(checks),
            "sct_p50_order_paper": order_paper, "sct_p50_order_ours": order_ours, "same_order": order_ours == [n for n in order_paper if n in tp8]}


def run_paper(out: Path, *, tp8_profile: str, router_profile: str, seed: int = 0, configs: list[str] | None = None,
              policies: list[str] | None = None, say=print, output_scale: float = OUTPUT_SCALE,
              start_gap_s: float = TP8_START_GAP_S, taus: tuple[float, ...] = TAUS, park: bool = False,
              router_start_gap_s: float = ROUTER_START_GAP_S, router_open_h2d_s: float | None = ROUTER_OPEN_H2D_S,
              router_seeds: int = ROUTER_SEEDS) -> dict[str, Any]:
    """Run both experiments; write ``out/summary.json`` (the issue's contract) and the reports. The router
    experiment runs once on ``seed`` (the report, the tau sweep, ``summary["router"]``) and, when
    ``router_seeds`` > 0, on task orders 0..router_seeds-1 beside least-pressure (``router_repetitions``: each
    router's medians and its paired per-seed TTFT p95 ratio, ``router_sweep``). Returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    p8, p4 = load(tp8_profile), testbed_profile(load(router_profile), router_open_h2d_s)
    rows = run_tp8(p8, configs or list(CONFIGS), seed, say, output_scale, start_gap_s, park)
    rrows, sweep = run_router(p4, policies or ["full", "least-pressure", "session-sticky"], seed, say, taus, output_scale, park, router_start_gap_s)
    report.write(out / "tp8", rows, {"profile": tp8_profile, "seed": seed, "output_scale": output_scale, "start_gap_s": start_gap_s}, "Simulated TP=8 fixed replay (Talaria §5.1-5.2)")
    report.write(out / "router", rrows + sweep, {"profile": router_profile, "seed": seed, "start_gap_s": router_start_gap_s}, "Simulated router experiment (Talaria §5.3-5.4)")
    tp8 = {s["name"]: {"sct_p50_s": s["sct_p50_s"], "sct_p95_s": s["sct_p95_s"], "ttft_p95_s": s["ttft_p95_s"]} for s in rows}
    router = {s["name"]: {"avoidable_opens": s["avoidable_opens"], "avoidable_opens_worker": s["avoidable_opens_worker"], "ttft_p95_s": s["ttft_p95_s"]}
              for s in rrows}
    detail = {s["name"]: report.lean(s) for s in rows}
    cmp_in = {n: {**tp8[n], "ttft_p50_s": detail[n]["ttft_p50_s"]} for n in tp8}
    summary = {
        "tp8": tp8,
        "router": router,
        "paper": PAPER,
        "tau_sweep": {f"{float(s['name'].split('=')[1]):.1f}": {
            "same_instance_return_rate": s["router"]["same_instance_return_rate"], "model_opens": s["router"]["model_opens"],
            "returning_ttft_p50_s": s["ttft_returning_p50_s"], "returning_ttft_p95_s": s["ttft_returning_p95_s"]} for s in sweep},
        "comparison": compare(cmp_in, router),
        "assumptions": {"output_scale": output_scale, "tp8_start_gap_s": start_gap_s, "router_start_gap_s": router_start_gap_s,
                        "router_open_h2d_s": p4.switch.open_h2d_s, "parking": park, "router_seeds": router_seeds,
                        "tp8_profile": tp8_profile, "router_profile": router_profile, "seed": seed},
    }
    summary["closing_note"] = {
        "not_within_15pct": [c["what"] for c in summary["comparison"]["checks"] if not c["within_15pct"]],
        "ablation_order_same": summary["comparison"]["same_order"],
        "why": list(NOTES),
    }
    variants = [p for p in (policies or ["full", "least-pressure", "session-sticky"]) if p != "least-pressure"]
    if router_seeds > 0 and variants:
        reps = router_sweep(p4, variants, [router_start_gap_s], router_seeds, say=say, open_h2d_s=None, park=park)
        summary["router_repetitions"] = {r["router"]: {k: v for k, v in r.items() if k not in ("router", "start_gap_s")} for r in reps}
    if "Talaria" in detail and "Round-only" in detail:
        t, b = detail["Talaria"], detail["Round-only"]
        summary["tp8_ratios"] = {"sct_p50_round_only_over_talaria": b["sct_p50_s"] / t["sct_p50_s"], "sct_p95_round_only_over_talaria": b["sct_p95_s"] / t["sct_p95_s"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def replace_knobs(profile: Profile, **kw: Any) -> Profile:
    return replace(profile, knobs={**profile.knobs, **kw})


def _variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"full"`` or ``"full:lease_arithmetic=false,replica_penalty_s=5"``: a router policy and ``PolicyParams``
    overrides (booleans, numbers); ValueError names an unknown field."""
    pol, _, rest = spec.partition(":")
    fields = set(PolicyParams.__dataclass_fields__)
    kw: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        if k not in fields:
            raise ValueError(f"{spec!r}: PolicyParams has no field {k!r}")
        kw[k] = {"true": True, "false": False}.get(v.lower(), None)
        if kw[k] is None:
            kw[k] = float(v)
    return pol, kw


def router_sweep(profile: Profile, variants: list[str], gaps: list[float], seeds: int, say=print,
                 baseline: str = "least-pressure", open_h2d_s: float | None = ROUTER_OPEN_H2D_S, park: bool = False) -> list[dict[str, Any]]:
    """The §5.3 testbed over offered loads (``gaps``: seconds between session starts) and ``seeds`` task orders
    per load, each router ``variants`` entry (``_variant``) beside ``baseline``: per load and variant the
    medians over seeds of avoidable opens, TTFT p95, SCT p50/p95 and same-instance returns, and the baseline's
    TTFT p95 over the variant's paired per seed (median and how many seeds the variant won) beside the ratio of
    the two medians. One task order is 120 calls, so a single seed's p95 is the 7th-worst call: the medians are
    what the testbed says. The switch from host is ``open_h2d_s`` seconds (``testbed_profile``; None: as
    ``profile`` has it); ``park`` as ``router_config``."""
    from statistics import median

    profile = testbed_profile(profile, open_h2d_s)
    rows = []
    for gap in gaps:
        runs: dict[str, list[dict[str, Any]]] = {}
        for seed in range(seeds):
            for spec in [baseline, *variants]:
                pol, kw = _variant(spec)
                cfg = router_config(profile, pol, park=park)
                if kw:
                    cfg = replace(cfg, params=replace(cfg.params, **kw))
                sessions = workload.router_subset(ROUTER_MODELS, seed=seed, output_scale=OUTPUT_SCALE, start_gap_s=gap)
                runs.setdefault(spec, []).append(report.summarize(Simulation(cfg, sessions).run()))
        base = runs[baseline]
        for spec, ss in runs.items():
            row = {
                "start_gap_s": gap, "router": spec, "seeds": seeds,
                "avoidable_opens": median(s["avoidable_opens"] for s in ss),
                "ttft_p95_s": median(s["ttft_p95_s"] for s in ss),
                "sct_p50_s": median(s["sct_p50_s"] for s in ss), "sct_p95_s": median(s["sct_p95_s"] for s in ss),
                "same_instance_returns": median(s["router"]["same_instance_return_rate"] for s in ss),
                "baseline_ttft_p95_over_this": median(b["ttft_p95_s"] / s["ttft_p95_s"] for b, s in zip(base, ss)),
                "baseline_median_over_this_median": median(b["ttft_p95_s"] for b in base) / median(s["ttft_p95_s"] for s in ss),
                "seeds_won_ttft_p95": sum(s["ttft_p95_s"] < b["ttft_p95_s"] for b, s in zip(base, ss)),
            }
            say(f"gap {gap:g} s {spec:40s} avoidable opens {row['avoidable_opens']:5.1f} TTFT p95 {row['ttft_p95_s']:6.2f} s "
                f"({row['baseline_ttft_p95_over_this']:.2f}x vs {baseline} paired, {row['baseline_median_over_this_median']:.2f}x of medians, "
                f"won {row['seeds_won_ttft_p95']}/{seeds}) "
                f"SCT p50/p95 {row['sct_p50_s']:.1f}/{row['sct_p95_s']:.1f} s same-instance returns {row['same_instance_returns']:.2f}")
            rows.append(row)
    return rows
