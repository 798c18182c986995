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

from bench.workloads import nearest_rank
from services.router.policy import PolicyParams

from . import report, workload
from .cluster import InstanceSpec, SimConfig, Simulation
from .paper import slot_policy
from .profile import load


def cluster(instances: int, models: int, hot_fraction: float = 0.5, max_loaded: int = 3) -> tuple[tuple[InstanceSpec, ...], list[str], list[float]]:
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
    for j in range(instances - len(specs)):
        start = tuple(tail[(j * max_loaded + i) % len(tail)] for i in range(min(max_loaded, len(tail))))
        specs.append(InstanceSpec(f"cold-{j}", "cold", tail, start, max_loaded))
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
        "decide_p50_us": s["decide_p50_us"], "decide_p99_us": s["decide_p99_us"],
        "policy_p50_us": s["policy_p50_us"], "policy_p99_us": s["policy_p99_us"],
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
