"""Reports of simulated runs, shaped like the bench matrix's (bench/report.py): per-configuration table,
ratios vs Round-only and vs Talaria, SCT/TTFT CDF PNGs (the matrix's own plotting), switch share of round
time, KV-hit split, router accounting, and ``summary.json``. Percentiles are nearest-rank (§5.1)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from bench.report import _plots, add_ratios
from bench.workloads import nearest_rank

from .cluster import RunResult


def summarize(r: RunResult) -> dict[str, Any]:
    """Numbers of one run (mutates nothing)."""
    scts = dict(r.sct)
    ttfts = [c.first_token_at - c.intended for c in r.calls if c.first_token_at is not None]
    ret = [c.first_token_at - c.intended for c in r.calls if c.first_token_at is not None and c.index > 0]
    src = Counter(c.kv_source for c in r.calls)
    n = max(1, len(r.calls))
    wall = sum(x.wall_s for _, x in r.rounds)
    sw = sum(x.switch_s for _, x in r.rounds)
    paths = Counter(s["path"] for s in r.switches)
    sp_adm = sum(x.sp_admitted for _, x in r.rounds)
    sp_def = sum(x.sp_deferred for _, x in r.rounds)
    rt = r.router
    dl = [i["deadlines"] for i in r.instances.values() if i.get("deadlines")]  # per-token deadlines, every instance
    first, first_ok = sum(d["first_tokens"] for d in dl), sum(d["first_on_time"] for d in dl)
    later, later_ok = sum(d["tokens"] for d in dl), sum(d["tokens_on_time"] for d in dl)
    return {
        "name": r.name, "calls": len(r.calls), "sessions": len(scts),
        "sct_p50_s": nearest_rank(list(scts.values()), 50), "sct_p95_s": nearest_rank(list(scts.values()), 95),
        "ttft_p50_s": nearest_rank(ttfts, 50), "ttft_p95_s": nearest_rank(ttfts, 95),
        "ttft_returning_p50_s": nearest_rank(ret, 50), "ttft_returning_p95_s": nearest_rank(ret, 95),
        "kv_hits": {k: src.get(k, 0) for k in ("device", "host", "recompute", "none")},
        "kv_hit_rate": {k: src.get(k, 0) / n for k in ("device", "host", "recompute", "none")},
        "rounds": len(r.rounds), "round_wall_s": wall, "switch_s": sw, "switch_share": sw / wall if wall > 0 else float("nan"),
        "switches": len(r.switches), "switch_paths": dict(paths),
        "sp_admitted": sp_adm, "sp_deferred": sp_def, "sp_admission_rate": sp_adm / (sp_adm + sp_def) if sp_adm + sp_def else float("nan"),
        "router": {k: rt.get(k) for k in ("decisions", "returns", "same_instance_returns", "lease_hits", "lease_expiries", "model_opens",
                                           "model_switches", "avoidable_cold_opens", "same_instance_return_rate", "lease_eq2_denied")},
        "avoidable_opens": rt.get("avoidable_cold_opens", 0),  # the router's count, on its view at the decision
        "avoidable_opens_worker": (rt.get("worker_opens") or {}).get("avoidable_opens", 0),  # on the workers' state (cluster._count_open)
        "opens_worker": (rt.get("worker_opens") or {}).get("opens", 0),
        "decide_p50_us": nearest_rank(r.decide_us, 50), "decide_p99_us": nearest_rank(r.decide_us, 99),
        "decide_p999_us": nearest_rank(r.decide_us, 99.9), "decide_max_us": max(r.decide_us, default=0.0),
        "policy_p50_us": nearest_rank(r.policy_us, 50), "policy_p99_us": nearest_rank(r.policy_us, 99),
        "snapshot_p50_us": nearest_rank(r.snapshot_us, 50), "snapshot_p99_us": nearest_rank(r.snapshot_us, 99),
        "deadline_attainment": (first_ok + later_ok) / (first + later) if first + later else float("nan"),
        "ttft_deadline_attainment": first_ok / first if first else float("nan"),
        "gap_p99_s": max((d["gap_p99_s"] for d in dl), default=float("nan")),
        # streaming hot-swap (partial_layers): streamed switches, first-forward stalls, mean startup prefix k* / groups
        "streams": sum(i.get("streams", 0) for i in r.instances.values()),
        "stream_stall_s": sum(i.get("stream_stall_s", 0.0) for i in r.instances.values()),
        "startup_share": _startup_share(r.instances.values()),
        "sim_s": r.end_s, "wall_s": r.wall_s, "sim_s_per_wall_s": r.end_s / r.wall_s if r.wall_s > 0 else float("nan"),
        "scts": scts, "ttfts": ttfts,
    }


def _startup_share(instances) -> float:
    """Mean k*/groups over the streamed switches (nan without one). Pure."""
    shares = [k / i["layer_groups"] for i in instances for k in i.get("startup_k", ())]
    return sum(shares) / len(shares) if shares else float("nan")


def _f(v: Any, unit: str = "") -> str:
    if isinstance(v, float):
        return "n/a" if not math.isfinite(v) else (f"{v:.3g}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}")
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("config", "SCT p50", "SCT p95", "TTFT p50", "TTFT p95", "SCT p50 vs Round-only", "switch share", "KV device/host/recompute", "SP adm.", "avoidable opens", "token deadlines met (TTFT)")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        kv = s["kv_hit_rate"]
        out.append("| " + " | ".join([
            s["name"], _f(s["sct_p50_s"], " s"), _f(s["sct_p95_s"], " s"), _f(s["ttft_p50_s"], " s"), _f(s["ttft_p95_s"], " s"),
            _f(s.get("sct_p50_vs_base", float("nan")), "x"), _f(s["switch_share"]),
            f"{kv['device']:.0%}/{kv['host']:.0%}/{kv['recompute']:.0%}", _f(s["sp_admission_rate"]), str(s["avoidable_opens"]),
            f"{_f(s.get('deadline_attainment', float('nan')))} ({_f(s.get('ttft_deadline_attainment', float('nan')))})",
        ]) + " |")
    return "\n".join(out)


def lean(s: dict[str, Any]) -> dict[str, Any]:
    """A summary without the per-session / per-call samples (for JSON output)."""
    return {k: v for k, v in s.items() if k not in ("scts", "ttfts")}


def write(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any], title: str) -> dict[str, Path]:
    """Write ``report.md``, ``runs.json`` and the CDF PNGs of ``rows`` (summaries) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    add_ratios([{"name": s["name"], "summary": s} for s in rows])
    plots = _plots(out, [{"name": s["name"], "summary": s} for s in rows])
    (out / "runs.json").write_text(json.dumps({"meta": meta, "runs": [lean(s) for s in rows]}, indent=2, default=str))
    md = [f"# {title}", "", "```", json.dumps(meta, indent=1, default=str), "```", "", table(rows), ""]
    md += [f"![{k}]({p.name})" for k, p in plots.items()]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return plots
