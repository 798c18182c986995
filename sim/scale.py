"""``talaria sim scale``: a hot/cold cluster past one machine (issue 15, "Past one machine").

Catalog of ``models`` models with Zipf(1) popularity; ``hot_fraction`` of the instances are hot and pin
the most popular models (instances per model proportional to popularity, at least one for each model
that gets any), the rest form a cold pool that serves the remaining catalog in rounds (each cold instance
starts with ``max_loaded`` tail models and opens others on demand). Sessions are the synthetic SWE-Bench
sessions at full scale, tiled (``workload.tiled``). Reports simulated seconds per wall second, placement
decision p50/p99 (the router's ``decide`` on the gateway's incremental index, per call), SCT, TTFT,
avoidable opens and models served per instance at the TTFT SLO (p95 TTFT of calls of the models an
instance serves <= SLO). Decode is coarsened to ``decode_quantum`` tokens per scheduler decision
(stated in the output) to keep the run on one core.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import random
from dataclasses import dataclass, field

from bench.workloads import nearest_rank
from services.router.policy import PolicyParams
from services.router.pool_sizing import InstanceInfo, PoolParams, PoolSizer, offered_work
from talaria import gctune
from talaria.config import RouterConfig

from . import report, workload
from .cluster import InstanceSpec, SimConfig, Simulation
from .paper import config_flags, engine_flags, slot_policy
from .profile import load


def cluster(instances: int, models: int, hot_fraction: float = 0.5, max_loaded: int = 3,
            cold_serves_all: bool = False) -> tuple[tuple[InstanceSpec, ...], list[str], list[float]]:
    catalog = [f"m{i:03d}" for i in range(models)]
    weights = [1.0 / (i + 1) for i in range(models)]
    n_hot = int(instances * hot_fraction)
    total = sum(weights)
    specs: list[InstanceSpec] = []
    hot_models: list[str] = []
    for m, w in zip(catalog, weights):
        k = int(n_hot * w / total)
        if k == 0 or len(specs) + k > n_hot:
            break
        hot_models.append(m)
        specs += [InstanceSpec(f"hot-{m}-{j}", "hot", (m,)) for j in range(k)]
    tail = tuple(m for m in catalog if m not in hot_models) or tuple(catalog)
    serves = tuple(catalog) if cold_serves_all else tail  # cold_serves_all: any model may fall back to the cold pool
    for j in range(instances - len(specs)):
        start = tuple(tail[(j * max_loaded + i) % len(tail)] for i in range(min(max_loaded, len(tail))))
        specs.append(InstanceSpec(f"cold-{j}", "cold", serves, start, max_loaded))
    return tuple(specs), catalog, weights


def run_scale(out: Path, *, profile: str, instances: int, models: int, sessions: int, seed: int = 0, rate_per_s: float = 20.0,
              slo_s: float = 10.0, decode_quantum: int = 16, output_scale: float = 0.1, base_sessions: int = 200, say=print) -> dict[str, Any]:
    """One cluster run; writes ``out/scale.json``. Returns the summary."""
    prof = load(profile)
    specs, catalog, weights = cluster(instances, models)
    ss = workload.tiled(sessions, catalog, weights, seed=seed, rate_per_s=rate_per_s, base_sessions=base_sessions)
    for s in ss:
        for c in s.calls:
            c.output_tokens = max(1, round(c.output_tokens * output_scale))
    cfg = SimConfig(f"{instances}x{models}", prof, specs, slot=slot_policy(prof), params=PolicyParams(policy="full"),
                    tau_s=float(prof.knobs.get("tau_s", 1.0)), heartbeat_s=1.0, decode_quantum=decode_quantum)
    t0 = time.perf_counter()
    sim = Simulation(cfg, ss)
    # the collector as the router process sets it after start-up (talaria/gctune.py): the simulated router
    # decides in this process, and with Python's defaults collections of the simulator's own heap land
    # inside its decisions (p99 1.3-1.6 ms instead of ~0.5 ms at 1,000 instances)
    with gctune.tuned(RouterConfig().gc_gen0_threshold) as thresholds:
        res = sim.run()
    s = report.summarize(res)
    by_inst: dict[str, list[float]] = {}
    for c in res.calls:
        by_inst.setdefault(c.instance, []).append(c.first_token_at - c.intended)
    served = {iid: len({c.model for c in res.calls if c.instance == iid}) for iid in by_inst}
    ok = [served[i] for i, t in by_inst.items() if nearest_rank(t, 95) <= slo_s]
    summary = {
        "instances": instances, "models": models, "sessions": sessions, "calls": s["calls"], "decode_quantum": decode_quantum,
        "sim_s": s["sim_s"], "wall_s": time.perf_counter() - t0, "sim_s_per_wall_s": s["sim_s"] / (time.perf_counter() - t0),
        "decide_p50_us": s["decide_p50_us"], "decide_p99_us": s["decide_p99_us"], "decide_p999_us": s["decide_p999_us"],
        "decide_max_us": s["decide_max_us"], "gc_thresholds": list(thresholds),
        "policy_p50_us": s["policy_p50_us"], "policy_p99_us": s["policy_p99_us"],
        "snapshot_p50_us": s["snapshot_p50_us"], "snapshot_p99_us": s["snapshot_p99_us"], "decide_clock": "thread CPU time (decide, snapshot); perf_counter (policy)",
        "sct_p50_s": s["sct_p50_s"], "sct_p95_s": s["sct_p95_s"], "ttft_p50_s": s["ttft_p50_s"], "ttft_p95_s": s["ttft_p95_s"],
        "avoidable_opens": s["avoidable_opens"], "model_opens": s["router"]["model_opens"],
        "ttft_slo_s": slo_s, "instances_meeting_slo": len(ok), "instances_used": len(by_inst),
        "models_per_instance_at_slo_mean": (sum(ok) / len(ok)) if ok else 0.0,
        "hot_instances": sum(1 for x in specs if x.pool == "hot"), "cold_instances": sum(1 for x in specs if x.pool == "cold"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(summary, indent=2, default=str))
    say(json.dumps(summary))
    return summary


# ------------------------------------------------------------------ dynamic pool sizing (issue 15)
@dataclass
class PoolLoop:
    """Drives ``services.router.pool_sizing.PoolSizer`` from the simulated router's telemetry: arrival rate
    (``Gateway.demand``), typical call (``Gateway.shapes``) and the profile's per-token costs (what heartbeats
    report). ``decode_batch``: sequences sharing a decode step on a hot instance (assumed)."""

    sizer: PoolSizer
    catalog: tuple[str, ...]
    prefill_per_token: float
    decode_step: float
    decode_batch: float = 4.0
    period_s: float = 30.0
    log: list = field(default_factory=list)

    def step(self, sim: Simulation, now: float) -> list[tuple[str, str, str | None]]:
        gw = sim.gateway
        rate = {m: gw.demand.rate(m, now) for m in self.catalog}
        shapes = {m: gw.shapes.shape(m) for m in self.catalog}
        work = offered_work(rate, {m: sh.suffix_tokens for m, sh in shapes.items()}, {m: sh.decode_tokens for m, sh in shapes.items()},
                            self.prefill_per_token, self.decode_step, self.decode_batch)
        infos = [InstanceInfo(iid, i.pool, tuple(i.loaded), i.idle() and not sim._busy[iid]) for iid, i in sim.instances.items()]
        moves = self.sizer.decide(work, infos)
        self.log += [(now, m.instance_id, m.to_pool, m.model) for m in moves]
        return [(m.instance_id, m.to_pool, m.model) for m in moves]


def drifted(sessions: list, catalog: list[str], seed: int) -> None:
    """Popularity drift (assumed workload): sessions starting in the second half of the arrival window use
    a seeded permutation of the catalog, so yesterday's tail models become today's head. Mutates calls."""
    perm = catalog[:]
    random.Random(seed + 7).shuffle(perm)
    remap = dict(zip(catalog, perm))
    mid = sessions[len(sessions) // 2].start_s if sessions else 0.0
    for s in sessions:
        if s.start_s >= mid:
            for c in s.calls:
                c.model = remap[c.model]


def run_pools(out: Path, *, profile: str, instances: int, models: int, sessions: int, splits: tuple[float, ...] = (0.25, 0.5, 0.75),
              seed: int = 0, rate_per_s: float = 5.0, slo_s: float = 10.0, decode_quantum: int = 16, output_scale: float = 0.1,
              say=print) -> dict[str, Any]:
    """Static hot fractions vs the dynamic pool sizer (starting from 0.5) on a drifting catalog; writes
    ``out/pools.json``. Returns {config: summary}."""
    prof = load(profile)
    rows: dict[str, Any] = {}
    for name, frac, dyn in [*((f"static-{f:g}", f, False) for f in splits), ("dynamic", 0.5, True)]:
        specs, catalog, weights = cluster(instances, models, hot_fraction=frac, cold_serves_all=True)
        ss = workload.tiled(sessions, catalog, weights, seed=seed, rate_per_s=rate_per_s)
        drifted(ss, catalog, seed)
        for s_ in ss:
            for c in s_.calls:
                c.output_tokens = max(1, round(c.output_tokens * output_scale))
        loop = None
        if dyn:
            c0 = prof.default
            loop = PoolLoop(PoolSizer(PoolParams(), lambda: sim.clock.now()), tuple(catalog), c0.prefill_per_token_at(8192), c0.decode_s(1, 0))
        cfg = SimConfig(name, prof, specs, slot=slot_policy(prof), params=PolicyParams(policy="full"), tau_s=float(prof.knobs.get("tau_s", 1.0)),
                        heartbeat_s=1.0, decode_quantum=decode_quantum, pool_sizer=loop)
        t0 = time.perf_counter()
        sim = Simulation(cfg, ss)
        res = sim.run()
        s = report.summarize(res)
        ttft = [c.first_token_at - c.intended for c in res.calls]
        rows[name] = {"hot_fraction_start": frac, "sct_p50_s": s["sct_p50_s"], "sct_p95_s": s["sct_p95_s"], "ttft_p50_s": s["ttft_p50_s"],
                      "ttft_p95_s": s["ttft_p95_s"], "ttft_within_slo": sum(t <= slo_s for t in ttft) / max(1, len(ttft)),
                      "avoidable_opens": s["avoidable_opens"], "model_opens": s["router"]["model_opens"], "sim_s": s["sim_s"],
                      "wall_s": time.perf_counter() - t0, "moves": len(loop.log) if loop else 0,
                      "hot_at_end": sum(1 for i in sim.instances.values() if i.pool == "hot")}
        say(f"pools {name}: {json.dumps(rows[name])}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pools.json").write_text(json.dumps({"instances": instances, "models": models, "sessions": sessions, "rate_per_s": rate_per_s,
                                                "drift": "second half of sessions on a permuted catalog", "rows": rows}, indent=2, default=str))
    return rows


def run_catalog(out: Path, *, profile: str, instances: int, catalogs: tuple[int, ...], sessions: int, seed: int = 0, rate_per_s: float = 5.0,
                slo_s: float = 10.0, decode_quantum: int = 16, output_scale: float = 0.1, per_model: bool = False, hot_fraction: float = 0.5,
                gpus_per_instance: int = 8, config: str = "Talaria", say=print) -> dict[str, Any]:
    """Models served per instance at the TTFT SLO as the catalog grows (Aegaeon reports 7 per GPU): the
    same session load on ``instances`` instances (half hot, Zipf catalog) with catalogs of growing size.
    A model counts as served at the SLO when the p95 TTFT of its calls is <= ``slo_s``; the figure is those
    models over the instances (TP=8 instances: divide by 8 for per GPU). ``per_model``: ``sessions`` and
    ``rate_per_s`` are per catalog model, so the offered load grows with the catalog (the SLO ceiling is where
    models at the SLO stop growing). ``hot_fraction``: share of instances in the hot pool (0: all pooled, as
    Aegaeon pools); ``gpus_per_instance``: for the per-GPU figure; ``config``: the cold pool's slot-policy row
(``paper.config_flags``: e.g. ``token-deadlines``, Aegaeon's EDF at token boundaries). Writes
``out/catalog.json``."""
    prof = load(profile)
    rows: dict[str, Any] = {}
    for n in catalogs:
        specs, catalog, weights = cluster(instances, n, hot_fraction=hot_fraction, cold_serves_all=False)
        k = n if per_model else 1
        ss = workload.tiled(sessions * k, catalog, weights, seed=seed, rate_per_s=rate_per_s * k)
        for s_ in ss:
            for c in s_.calls:
                c.output_tokens = max(1, round(c.output_tokens * output_scale))
        cfg = SimConfig(f"catalog-{n}", prof, specs, slot=slot_policy(prof, **config_flags(config)), params=PolicyParams(policy="full"),
                        tau_s=float(prof.knobs.get("tau_s", 1.0)), heartbeat_s=1.0, decode_quantum=decode_quantum, **engine_flags(config))
        t0 = time.perf_counter()
        res = Simulation(cfg, ss).run()
        s = report.summarize(res)
        by_model: dict[str, list[float]] = {}
        for c in res.calls:
            by_model.setdefault(c.model, []).append(c.first_token_at - c.intended)
        ok = [m for m, t in by_model.items() if nearest_rank(t, 95) <= slo_s]
        rows[str(n)] = {"sessions": sessions * k, "rate_per_s": rate_per_s * k, "calls": len(res.calls), "models_requested": len(by_model), "models_at_slo": len(ok), "models_per_instance_at_slo": len(ok) / instances,
                        "models_per_gpu_at_slo": len(ok) / (instances * gpus_per_instance), "sct_p50_s": s["sct_p50_s"], "sct_p95_s": s["sct_p95_s"],
                        "ttft_p95_s": s["ttft_p95_s"], "avoidable_opens": s["avoidable_opens"],
                        "deadline_attainment": s["deadline_attainment"], "ttft_deadline_attainment": s["ttft_deadline_attainment"],
                        "wall_s": time.perf_counter() - t0}
        say(f"catalog {n}: {json.dumps(rows[str(n)])}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "catalog.json").write_text(json.dumps({"config": config, "instances": instances, "sessions": sessions, "per_model": per_model, "slo_s": slo_s, "hot_fraction": hot_fraction,
                                                  "gpus_per_instance": gpus_per_instance, "profile": profile, "rows": rows},
                                                 indent=2, default=str))
    return rows
