"""Report of a replay / a matrix of replays: numbers, ratios, plots, Markdown.

Every number names its source (the ``SOURCES`` table is printed in the report):

* **client** — the replay client's own timestamps and the responses it received (``bench/replay.py``):
  SCT, schedule-aware and request-local TTFT, errors, usage (cached and host-restored tokens), the instance each call was
  answered from (``X-Talaria-Instance``);
* **router** — the router's ``/health`` placement counters, read before and after the replay (the
  difference is reported, so warmup calls are excluded): avoidable cold opens, returns, same-instance
  returns, model switches, lease hits;
* **engine** — engine heartbeats (``InstanceSnapshot``, read straight from NATS by the matrix): switch
  records (path, seconds), switch counts;
* **kvstore** — the kvstore's ``Stats`` RPC before/after: host restores and restored pages;
* **telemetry** — the telemetry service's records file (issue 7) filtered to the replay window: round
  summaries (wall = active + switch, SP admitted/deferred) when engines publish them (issue 5), call
  records (predicted KV source, avoidable opens).

A number whose source did not produce it is ``n/a`` with the reason, never a guess. Percentiles are
nearest-rank (Talaria §5.1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench import format_table
from bench.stats import unit_means, vs_best_fixed, wins_losses
from bench.workloads import nearest_rank
from services.telemetry.collector import record_number

SOURCES = {
    "client": "replay client timestamps and responses (bench/replay.py)",
    "router": "router /health placement counters, after - before the replay",
    "engine": "engine heartbeats (InstanceSnapshot) on NATS: switch records",
    "kvstore": "kvstore Stats RPC, after - before the replay",
    "telemetry": "telemetry service records file (round/call records) in the replay window",
}

NA = float("nan")
CI_SEED = 0  # bootstrap seed: the intervals are reproducible from summary.json


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def session_scts(res) -> dict[str, float]:
    """SCT per session (client): end of the last response - intended enqueue of the first call.
    A session with a failed call is left out (its SCT would not be comparable)."""
    by: dict[str, list] = {}
    for c in res.calls:
        by.setdefault(c.session_id, []).append(c)
    out = {}
    for sid, cs in by.items():
        cs.sort(key=lambda c: c.call_index)
        if all(c.ok for c in cs):
            out[sid] = cs[-1].end - cs[0].intended
    return out


def summarize_run(res, telemetry: dict[str, Any]) -> dict[str, Any]:
    """Every metric of one replay (one configuration)."""
    calls = res.calls
    ok = [c for c in calls if c.ok]
    scts = session_scts(res)
    ttft = [c.ttft for c in ok]
    ttft_req = [c.ttft_request for c in ok]
    s: dict[str, Any] = {
        "calls": len(calls),
        "calls_failed": len(calls) - len(ok),
        "errors": sorted({c.error for c in calls if c.error})[:5],
        "retries": sum(c.retries for c in calls),
        "sessions": len({c.session_id for c in calls}),
        "sessions_complete": len(scts),
        "wall_s": res.wall_s,
        "sct_p50_s": nearest_rank(list(scts.values()), 50),
        "sct_p95_s": nearest_rank(list(scts.values()), 95),
        "ttft_p50_s": nearest_rank(ttft, 50),
        "ttft_p95_s": nearest_rank(ttft, 95),
        "ttft_req_p50_s": nearest_rank(ttft_req, 50),
        "ttft_req_p95_s": nearest_rank(ttft_req, 95),
        "scts": scts,
        "ttfts": ttft,
        "tokens_out": sum(c.completion_tokens for c in ok),
        "tokens_out_expected": sum(c.recorded_output_tokens for c in calls),
        "prompt_tokens": sum(c.prompt_tokens for c in ok),
        "cached_tokens": sum(c.cached_tokens for c in ok),
        "kv_hit_calls": sum(1 for c in ok if c.cached_tokens > 0),
        "reusable_prefix_tokens": sum(c.recorded_prefix_tokens for c in ok),
    }
    s["cached_share"] = s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else NA
    s["reuse_captured"] = s["cached_tokens"] / s["reusable_prefix_tokens"] if s["reusable_prefix_tokens"] else NA
    # client-side same-instance return rate (continuations answered by the previous call's instance)
    by: dict[str, list] = {}
    for c in calls:
        by.setdefault(c.session_id, []).append(c)
    same = total = 0
    for cs in by.values():
        cs.sort(key=lambda c: c.call_index)
        for a, b in zip(cs, cs[1:]):
            if a.instance and b.instance:
                total += 1
                same += a.instance == b.instance
    s["same_instance_client"] = same / total if total else NA
    s.update(_router_metrics(telemetry.get("router_before"), telemetry.get("router_after")))
    s.update(_engine_metrics(telemetry.get("switches"), telemetry.get("instances", 0), res.wall_s))
    s.update(_kvstore_metrics(telemetry.get("kvstore_before"), telemetry.get("kvstore_after")))
    s.update(kv_hits_by_source(ok))
    s.update(_records_metrics(telemetry.get("records"), telemetry.get("records_note", "")))
    s["latency_split"] = latency_split(telemetry.get("records"))
    return s


def _router_metrics(before: dict | None, after: dict | None) -> dict[str, Any]:
    if not after:
        return {"avoidable_cold_opens": NA, "same_instance_router": NA, "model_switches_router": NA, "lease_hits": NA}
    b = (before or {}).get("placement", {})
    a = after.get("placement", {})

    def d(k: str) -> float:
        return float(a.get(k, 0) or 0) - float(b.get(k, 0) or 0)

    returns = d("returns")
    return {
        "avoidable_cold_opens": d("avoidable_cold_opens"),
        "rotation_joins": d("rotation_joins"),
        "avoidable_rotation_joins": d("avoidable_rotation_joins"),
        "model_opens_router": d("model_opens"),
        "model_switches_router": d("model_switches"),
        "same_instance_router": d("same_instance_returns") / returns if returns else NA,
        "lease_hits": d("lease_hits"),
        "lease_misses": d("lease_misses"),
        # issue 14: leases installed but not hit, expiries, declined / outweighed by the lease arithmetic,
        # committed tokens x seconds held by leases (device KV they reserved)
        "leases_installed": d("leases_installed"),
        "leases_unused": d("leases_installed") - d("lease_hits"),
        "lease_expiries": d("lease_expiries"),
        "leases_declined": d("leases_declined"),
        "lease_outweighed": d("lease_outweighed"),
        "lease_token_s": d("lease_token_s"),
    }


def _engine_metrics(switches: list[dict] | None, instances: int, wall_s: float) -> dict[str, Any]:
    if switches is None:
        return {"switches": NA, "switch_s": NA, "switch_share_proxy": NA, "switch_paths": {}}
    total = sum(float(r.get("total_seconds", 0) or 0) for r in switches)
    paths: dict[str, int] = {}
    for r in switches:
        paths[str(r.get("path", "?"))] = paths.get(str(r.get("path", "?")), 0) + 1
    return {
        "switches": len(switches),
        "switch_s": total,
        "switch_p50_ms": nearest_rank([float(r.get("total_seconds", 0)) * 1e3 for r in switches], 50),
        "switch_share_proxy": total / (max(1, instances) * wall_s) if wall_s > 0 else NA,
        "switch_paths": paths,
    }


def _kvstore_metrics(before: dict | None, after: dict | None) -> dict[str, Any]:
    if not after:
        return {"host_restores": NA, "host_restore_pages": NA, "host_checkpoint_bytes": NA}
    b = before or {}

    def d(k: str) -> float:
        return float(after.get(k, 0) or 0) - float(b.get(k, 0) or 0)

    return {"host_restores": d("restores"), "host_restore_pages": d("hit_pages"), "host_checkpoint_bytes": d("bytes_in")}


def kv_hits_by_source(ok: list) -> dict[str, Any]:
    """KV hits by source, exact per call, from the usage the client received (``restored_tokens``, the
    router's ``prompt_tokens_details`` extension): tokens device = cached - restored, host = restored,
    recompute = prompt - cached; a call counts as ``host`` when it restored any token, else ``device`` when
    any was cached, else ``recompute`` (the telemetry service's rule). ``kv_hits_source`` says what the
    report's KV-hit cell uses: ``usage`` (exact) when every successful call carried ``restored_tokens``, else
    ``estimate`` (calls with cached tokens / kvstore restores; the per-source numbers are then n/a)."""
    if not ok or any(getattr(c, "restored_tokens", None) is None for c in ok):
        return {"kv_hits_source": "estimate", "kv_hit_calls_by_source": {}, "kv_hit_tokens_by_source": {}}
    calls = {"device": 0, "host": 0, "recompute": 0}
    tokens = {"device": 0, "host": 0, "recompute": 0}
    for c in ok:
        prompt = max(0, c.prompt_tokens)
        cached = min(max(0, c.cached_tokens), prompt)
        restored = min(max(0, c.restored_tokens), cached)
        split = {"device": cached - restored, "host": restored, "recompute": prompt - cached}
        for k, v in split.items():
            tokens[k] += v
        calls["host" if split["host"] else "device" if split["device"] else "recompute"] += 1
    return {"kv_hits_source": "usage", "kv_hit_calls_by_source": calls, "kv_hit_tokens_by_source": tokens}


def _deadline_attainment(rounds: list[dict]) -> dict[str, Any]:
    """Per-token deadline attainment over the replay window's round records: the cold engines score every
    first token against arrival + slot_ttft_s and every later token against first token + (i-1) x slot_tpot_s,
    in both scheduling modes (rounds or token deadlines; ``RoundSummary.token_deadlines``), so the sums over
    the window's rounds are exact. ``deadline_first`` / ``deadline_later``: the share on time (n/a when no
    round scored a token of that kind, or the engines predate the field)."""
    sums = {"first_tokens": 0.0, "first_on_time": 0.0, "tokens": 0.0, "tokens_on_time": 0.0}
    scored = False
    for r in rounds:
        td = r.get("token_deadlines")
        if isinstance(td, dict):
            scored = True
            for k in sums:
                sums[k] += record_number(td, k)  # a JSON-encoded proto carries 64-bit counts as strings
    if not scored:
        return {"deadline_first": NA, "deadline_later": NA, "deadline_tokens": {}}
    return {"deadline_first": sums["first_on_time"] / sums["first_tokens"] if sums["first_tokens"] else NA,
            "deadline_later": sums["tokens_on_time"] / sums["tokens"] if sums["tokens"] else NA,
            "deadline_tokens": sums}


def _records_metrics(records: list[dict] | None, note: str) -> dict[str, Any]:
    out: dict[str, Any] = {"records_note": note}
    if records is None:
        out.update({"rounds": NA, "sp_admitted": NA, "sp_deferred": NA, "sp_no_gain": NA, "switch_share_rounds": NA, "kv_source_pred": {}})
        return out
    rounds = [r for r in records if r.get("kind") == "round"]
    out["rounds"] = len(rounds)
    if rounds:
        wall = sum(record_number(r, "wall_seconds", "wall_s", "wall_ms") / (1e3 if "wall_ms" in r and "wall_seconds" not in r else 1) for r in rounds)
        sw = sum(record_number(r, "switch_seconds", "switch_s", "switch_ms") / (1e3 if "switch_ms" in r and "switch_seconds" not in r else 1) for r in rounds)
        out["switch_share_rounds"] = sw / wall if wall else NA
        out["sp_admitted"] = sum(record_number(r, "sp_admitted") for r in rounds)
        out["sp_deferred"] = sum(record_number(r, "sp_deferred") for r in rounds)
        # SP that cannot lose (issue 12): deferral reasons and the predicted benefit / harm of what SP admitted,
        # when the engines' round summaries carry them (n/a for an older engine)
        if any("sp_deferred_reasons" in r for r in rounds):
            reasons: dict[str, float] = {}
            for r in rounds:
                for k, v in (r.get("sp_deferred_reasons") or {}).items():
                    reasons[k] = reasons.get(k, 0.0) + float(v)
            out["sp_deferred_reasons"] = reasons
            out["sp_no_gain"] = reasons.get("no_gain", 0.0)
            out["sp_benefit_s"] = sum(record_number(r, "sp_benefit_s") for r in rounds)
            out["sp_harm_s"] = sum(record_number(r, "sp_harm_s") for r in rounds)
        else:
            out.update({"sp_deferred_reasons": {}, "sp_no_gain": NA, "sp_benefit_s": NA, "sp_harm_s": NA})
        # slots held for expected returns (slots/hold.py): how often, how long, and the predicted gain / harm
        if any("holds" in r for r in rounds):
            out["holds"] = sum(record_number(r, "holds") for r in rounds)
            out["hold_s"] = sum(float((r.get("phase_s") or {}).get("hold", 0.0)) for r in rounds)
            out["hold_gain_s"] = sum(record_number(r, "hold_gain_s") for r in rounds)
            out["hold_harm_s"] = sum(record_number(r, "hold_harm_s") for r in rounds)
        else:
            out.update({"holds": NA, "hold_s": NA, "hold_gain_s": NA, "hold_harm_s": NA})
        out.update(_deadline_attainment(rounds))
    else:
        out.update({"sp_admitted": NA, "sp_deferred": NA, "switch_share_rounds": NA, "sp_no_gain": NA})
    src: dict[str, int] = {}
    for r in records:
        if r.get("kind") == "call" and r.get("phase") == "start":
            k = str(r.get("kv_source") or "none")
            src[k] = src.get(k, 0) + 1
    out["kv_source_pred"] = src
    out["avoidable_opens_records"] = sum(1 for r in records if r.get("kind") == "call" and r.get("phase") == "start" and r.get("avoidable_open"))
    return out


# ------------------------------------------------------------------------- call latency attribution
# Issue 12 item 1 (report half): a call's latency split into components recorded *by the engine and router*
# per call (exact, not estimated). The call records (telemetry ``CallRecord``, phase "end") are searched for
# each component under the keys listed (top level, or inside an ``attribution`` / ``latency`` map, as
# seconds); a component no record carries is reported as "not recorded" — never estimated. The part of the
# call's latency (``end_unix - arrival_unix``) the recorded components do not cover is shown as
# "unattributed", so an incomplete split is visible as such. This build records every component
# (``talaria/attribution.py``: the engine's phase clock per call, the router's queue and placement) in
# ``CallRecord.attribution``, whose ``other_s`` is the recorder's own residual (transit, publishing, HTTP):
# "unattributed" is then ~0 and "other" says how much the named components leave unexplained.
LATENCY_COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("router queue", ("router_queue_s", "router_queue_seconds")),
    ("placement", ("placement_s", "placement_seconds")),
    ("engine queue", ("engine_queue_s", "engine_queue_seconds", "queue_seconds")),
    ("round wait", ("round_wait_s", "round_wait_seconds")),
    ("switch wait", ("switch_wait_s", "switch_wait_seconds")),
    ("KV restore", ("restore_s", "restore_seconds", "kv_restore_s", "kv_restore_seconds")),
    ("prefill", ("prefill_s", "prefill_seconds", "prefill_recompute_s", "prefill_recompute_seconds")),
    ("decode", ("decode_s", "decode_seconds")),
    ("preemption", ("preemption_s", "preemption_seconds", "preempted_s", "preempted_seconds")),
    # the residual the recorder itself reports (talaria/attribution.py: NATS transit, publishing, HTTP)
    ("other", ("other_s",)),
)


def _component(rec: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for src in (rec, rec.get("attribution") or {}, rec.get("latency") or {}):
        if not isinstance(src, dict):
            continue
        for k in keys:
            v = src.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                return float(v)
    return None


def latency_split(records: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Mean seconds per completed call of each latency component, from the call-end records that carry it
    (``None``: not recorded by any call), the mean call latency, and what the recorded components leave
    unattributed. Pure."""
    if records is None:
        return {"source": "n/a (no records)", "calls": 0, "components": {n: None for n, _k in LATENCY_COMPONENTS}}
    ends = [r for r in records if r.get("kind") == "call" and r.get("phase") == "end" and not r.get("error")]
    comps: dict[str, float | None] = {}
    for name, keys in LATENCY_COMPONENTS:
        vals = [v for r in ends if (v := _component(r, keys)) is not None]
        comps[name] = sum(vals) / len(ends) if vals else None
    totals = [float(r["end_unix"]) - float(r["arrival_unix"]) for r in ends
              if _finite(r.get("end_unix")) and _finite(r.get("arrival_unix")) and r["end_unix"] and r["arrival_unix"]]
    total = sum(totals) / len(totals) if totals else NA
    recorded = sum(v for v in comps.values() if v is not None)
    return {"source": "telemetry call records (phase end)", "calls": len(ends), "components": comps, "total_s": total,
            "unattributed_s": max(0.0, total - recorded) if _finite(total) else NA, "by_placement": _split_by_placement(records, ends),
            "compute": compute_overlap(records)}


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``spans``."""
    out, cur = 0.0, None
    for a, b in sorted(spans):
        if cur is None or a > cur[1]:
            out += (cur[1] - cur[0]) if cur else 0.0
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return out + ((cur[1] - cur[0]) if cur else 0.0)


def compute_overlap(records: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What the per-call split cannot show (issue 12): how much work the engines did and how fast. From the
    completion hooks (warmup sessions left out): prompt tokens actually prefilled (prompt - cached), each
    call's compute span (its prefill + decode phases, ending at its finish), the seconds any engine computed
    (the union of all spans), the seconds two or more instances computed at once (sum of the per-instance
    unions minus the union), and compute seconds per prefilled token. Instances that share CPU cores (the
    local stack on a small machine) slow each other down while both compute: a configuration that spreads
    the same work over both engines then shows a higher ``ms_per_prefill_token`` and ``overlap_s``. Pure."""
    hooks = [r for r in records or () if r.get("kind") == "hook" and not str(r.get("session_id", "")).startswith("warmup")]
    spans: dict[str, list[tuple[float, float]]] = {}
    tokens = 0
    for h in hooks:
        u, a = h.get("usage") or {}, h.get("attribution") or {}
        tokens += max(0, int(u.get("prompt_tokens", 0) or 0) - int(u.get("cached_tokens", 0) or 0))
        end = float(h.get("finish_unix") or 0.0)
        busy = float(a.get("prefill_s", 0.0) or 0.0) + float(a.get("decode_s", 0.0) or 0.0)
        if end > 0 and busy > 0:
            spans.setdefault(str(h.get("instance_id", "")), []).append((end - busy, end))
    any_s = _union([s for v in spans.values() for s in v])
    per = sum(_union(v) for v in spans.values())
    return {"calls": len(hooks), "prefill_tokens": tokens, "compute_s": any_s, "overlap_s": per - any_s,
            "ms_per_prefill_token": 1e3 * any_s / tokens if tokens else NA}


def _split_by_placement(records: list[dict[str, Any]], ends: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Mean components per group of calls with the same placement (reason / lease outcome / predicted KV
    source / whether the placement switches the model), joined from the call's start record: which calls a
    difference between configurations comes from. Pure."""
    starts = {r.get("request_id"): r for r in records if r.get("kind") == "call" and r.get("phase") == "start"}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in ends:
        s = starts.get(r.get("request_id"), {})
        key = "/".join([str(s.get("placement_reason") or "?"), str(s.get("lease") or "?"), str(s.get("kv_source") or "?"),
                        "switch" if s.get("switches_model") else "resident"])
        groups.setdefault(key, []).append(r)
    out = {}
    for key, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        comps = {}
        for name, keys in LATENCY_COMPONENTS:
            vals = [v for r in rs if (v := _component(r, keys)) is not None]
            comps[name] = sum(vals) / len(rs) if vals else None
        out[key] = {"calls": len(rs), "components": comps}
    return out


def placement_split_table(ls: dict[str, Any]) -> str:
    """The per-placement groups of one configuration's ``latency_split`` as a table."""
    groups = ls.get("by_placement") or {}
    names = [n for n, _k in LATENCY_COMPONENTS]
    body = [[k, g["calls"]] + [f"{g['components'][n]:.3f}" if g["components"].get(n) is not None else "-" for n in names]
            for k, g in groups.items()]
    return format_table(["reason/lease/kv/model", "calls"] + names, body)


def latency_table(rows: list[dict[str, Any]]) -> str:
    ran = [r for r in rows if r.get("summary") and r["summary"].get("latency_split")]
    headers = ["configuration", "calls"] + [n for n, _k in LATENCY_COMPONENTS] + ["unattributed", "call latency",
                                                                                  "prefilled tok", "compute s", "engines overlap s", "ms/prefilled tok"]
    body = []
    for r in ran:
        ls = r["summary"]["latency_split"]
        cp = ls.get("compute") or {}
        body.append([r["name"], ls.get("calls", 0)] + [f"{v:.3f}" if v is not None else "not recorded" for v in ls["components"].values()]
                    + [f"{ls.get('unattributed_s', NA):.3f}" if _finite(ls.get("unattributed_s", NA)) else "n/a",
                       f"{ls.get('total_s', NA):.3f}" if _finite(ls.get("total_s", NA)) else "n/a"]
                    + ([cp["prefill_tokens"], f"{cp['compute_s']:.1f}", f"{cp['overlap_s']:.1f}",
                        f"{cp['ms_per_prefill_token']:.2f}" if _finite(cp["ms_per_prefill_token"]) else "n/a"] if cp else ["n/a"] * 4))
    return format_table(headers, body)


# ------------------------------------------------------------------------------------ rendering
COLUMNS = [
    # header, key, source
    ("SCT p50 s", "sct_p50_s", "client"),
    ("SCT p95 s", "sct_p95_s", "client"),
    ("p50/Round-only", "sct_p50_vs_base", "client"),
    ("p95/Round-only", "sct_p95_vs_base", "client"),
    ("p50/best (CI)", "sct_p50_vs_best", "client; best = fastest baseline row; CI: paired session bootstrap (bench/stats.py)"),
    ("p95/best (CI)", "sct_p95_vs_best", "client; as above"),
    ("p50/Talaria", "sct_p50_vs_talaria", "client"),
    ("TTFT p50 s", "ttft_p50_s", "client"),
    ("TTFT p95 s", "ttft_p95_s", "client"),
    ("avoid. opens", "avoidable_cold_opens", "router"),
    ("same-inst", "same_instance_router", "router"),
    ("switch share", "switch_share", "telemetry/engine"),
    ("deadlines first/later", "deadlines", "telemetry round summaries: share of first tokens / later tokens on their per-token deadline (slot_ttft_s, slot_tpot_s)"),
    ("SP adm/def", "sp", "telemetry round summaries; `no-gain`: deferred because the predicted round wait saved did not exceed the delay to other models (issue 12)"),
    ("KV hits dev/host", "kv_hits", "client usage (exact); `~`: client/kvstore estimate"),
    ("failed", "calls_failed", "client"),
    ("engaged: rounds/hostKV/D2D", "evidence", "telemetry/kvstore/engine"),
    ("engine CPU s", "engine_cpu_s", "/proc: CPU seconds the engine processes used during the replay (work done; hardly depends on machine load)"),
    ("load 1m", "load", "/proc/loadavg 1-minute average before -> after this run"),
    ("machine GF/s, GB/s", "machine", "bench/machine.py: bf16 GEMM GFLOP/s and streaming-read GB/s probed before this run, the stack idle"),
]


def baseline_names(rows: list[dict[str, Any]], baseline: str = "Round-only") -> list[str]:
    """The configurations the "best baseline" is chosen from: rows of kind ``baseline`` (bench/matrix.py),
    else just ``baseline``."""
    names = [r["name"] for r in rows if r.get("kind") == "baseline"]
    return names or [baseline]


def add_ratios(rows: list[dict[str, Any]], baseline: str = "Round-only", reference: str = "Talaria") -> None:
    """Set on every summary its ratios vs ``baseline`` (``_vs_base``), vs ``reference`` (``_vs_talaria``) and
    vs the best baseline (``_vs_best``: per metric the smallest value among the baseline rows that ran, whose
    name is ``best_baseline_<metric>``), plus session-level bootstrap intervals of the SCT ratios
    (``<ratio>_ci``, bench/stats.py) and the sessions won/lost vs ``baseline``. Mutates the summaries."""
    from bench.stats import bootstrap_ratio_ci, paired_wins

    by = {r["name"]: r for r in rows if r.get("summary")}
    base = by.get(baseline, {}).get("summary")
    ref = by.get(reference, {}).get("summary")
    named = [(n, by[n]["summary"]) for n in baseline_names(rows, baseline) if n in by]
    bases = [b for _n, b in named]
    for r in rows:
        s = r.get("summary")
        if not s:
            continue
        for m in ("sct", "ttft"):
            for q in ("p50", "p95"):
                k = f"{m}_{q}_s"
                v = s[k]
                s[f"{m}_{q}_vs_base"] = v / base[k] if base and _finite(base[k]) and base[k] > 0 else NA
                s[f"{m}_{q}_vs_talaria"] = v / ref[k] if ref and _finite(ref[k]) and ref[k] > 0 else NA
                cands = [(b[k], n) for n, b in named if _finite(b.get(k)) and b[k] > 0]
                best = min(cands, default=None)
                s[f"{m}_{q}_vs_best"] = v / best[0] if best else NA
                s[f"best_baseline_{m}_{q}"] = best[1] if best else None
        for q, qn in ((50, "p50"), (95, "p95")):
            s[f"sct_{qn}_vs_base_ci"] = list(bootstrap_ratio_ci([(s["scts"], [base["scts"]])], q, seed=CI_SEED)) if base else [NA, NA]
            s[f"sct_{qn}_vs_best_ci"] = list(bootstrap_ratio_ci([(s["scts"], [b["scts"] for b in bases])], q, seed=CI_SEED)) if bases else [NA, NA]
        won, lost, tied = paired_wins(s["scts"], base["scts"]) if base else (0, 0, 0)
        s["sessions_won_lost_tied_vs_base"] = [won, lost, tied]


def _load_cell(s: dict[str, Any]) -> str:
    b, a = s.get("loadavg_before"), s.get("loadavg_after")
    return f"{b[0]:.2f}->{a[0]:.2f}" if b and a else "n/a"


def _ci_cell(v: Any, ci: Any) -> str:
    if not _finite(v):
        return "n/a"
    if ci and len(ci) == 2 and all(_finite(x) for x in ci):
        return f"{v:.2f} ({ci[0]:.2f}-{ci[1]:.2f})"
    return f"{v:.2f}"


def _machine_cell(s: dict[str, Any]) -> str:
    m = s.get("machine") or {}
    return f"{m['gemm_gflops']:.0f}, {m['read_gb_s']:.1f}" if m else "n/a"


def _cell(s: dict[str, Any], key: str) -> object:
    if key == "load":
        return _load_cell(s)
    if key == "machine":
        return _machine_cell(s)
    if key in ("sct_p50_vs_best", "sct_p95_vs_best"):
        return _ci_cell(s.get(key, NA), s.get(f"{key}_ci"))
    if key == "switch_share":
        v = s.get("switch_share_rounds", NA)
        if _finite(v):
            return f"{v:.1%}"
        v = s.get("switch_share_proxy", NA)
        return f"{v:.1%}*" if _finite(v) else "n/a"
    if key == "deadlines":
        f, l = s.get("deadline_first", NA), s.get("deadline_later", NA)
        if not (_finite(f) or _finite(l)):
            return "n/a"
        return f"{f:.0%}/{l:.0%}" if _finite(f) and _finite(l) else (f"{f:.0%}/n/a" if _finite(f) else f"n/a/{l:.0%}")
    if key == "sp":
        a, d, ng = s.get("sp_admitted", NA), s.get("sp_deferred", NA), s.get("sp_no_gain", NA)
        if not (_finite(a) and _finite(d)):
            return "n/a"
        return f"{int(a)}/{int(d)}" + (f" ({int(ng)} no-gain)" if _finite(ng) else "")
    if key == "kv_hits":
        if s.get("kv_hits_source") == "usage":  # exact, per call (kv_hits_by_source)
            by = s["kv_hit_calls_by_source"]
            return f"{by['device']}/{by['host']}"
        dev = s.get("kv_hit_calls", NA)
        host = s.get("host_restores", NA)
        return f"~{dev}/{int(host) if _finite(host) else 'n/a'}"
    if key == "evidence":  # did each mechanism actually run? (a knob that exists may not be wired yet)
        r, hb, paths = s.get("rounds", NA), s.get("host_checkpoint_bytes", NA), s.get("switch_paths") or {}
        staged = sum(v for k, v in paths.items() if k in ("full_staged", "partial"))
        return (f"{int(r) if _finite(r) else 'n/a'}/{_mib(hb)}/"
                f"{staged}of{sum(paths.values())}" if paths or _finite(hb) or _finite(r) else "n/a")
    if key == "same_instance_router":
        v = s.get(key, NA)
        return f"{v:.1%}" if _finite(v) else "n/a"
    if key == "engine_cpu_s":
        v = s.get(key, NA)
        return f"{v:.1f}" if _finite(v) else "n/a"
    v = s.get(key, NA)
    if isinstance(v, float) and _finite(v) and key == "avoidable_cold_opens":
        return int(v)
    return v


def _mib(b: Any) -> str:
    return f"{b / 2**20:.1f}MiB" if _finite(b) else "n/a"


def matrix_table(rows: list[dict[str, Any]]) -> str:
    headers = ["configuration"] + [h for h, _k, _s in COLUMNS]
    body, notes = [], []
    for r in rows:
        s = r.get("summary")
        if not s:
            body.append([r["name"]] + ["-"] * len(COLUMNS))
            notes.append(f"{r['name']}: {r.get('status', 'n/a')}")
            continue
        body.append([r["name"]] + [_cell(s, k) for _h, k, _s in COLUMNS])
    return format_table(headers, body) + "".join("\n" + n for n in notes)


def write_matrix_report(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any],
                        repeats: list[list[dict[str, Any]]] | None = None) -> Path:
    """``rows``: one per configuration. With ``repeats`` (``--repeats N``: the rows of every repetition),
    ``rows`` come from ``combine_repeats`` (ratios already the medians of per-repetition ratios) and the
    report leads with the medians table and the per-repetition table."""
    if repeats is None:
        add_ratios(rows)
    plots = _plots(out, rows)
    table = matrix_table(rows)
    lines = [
        "# Talaria fixed-replay matrix",
        "",
        f"Command: `{meta.get('command', '')}`",
        "",
        f"Workload: {meta.get('workload_desc', '')}",
        "",
        f"Load average (1/5/15 min) at the start: {meta.get('loadavg_start', 'n/a')}, at the end: {meta.get('loadavg_end', 'n/a')}; "
        "per run in the `load 1m` columns and in summary.json (`loadavg_before` / `loadavg_after`). The machine's own speed, "
        "which the load average does not see on a shared host, is probed before each run (bench/machine.py: bf16 GEMM GFLOP/s "
        "and streaming-read GB/s, the stack idle; `machine` in summary.json, the `machine` and `GEMM GF/s` columns).",
        "",
        "Best baseline: per repetition and per metric, the fastest of the baseline configurations that ran "
        "(every mechanism off; with the full router and with the least-pressure router). `/best` ratios are "
        "computed within each repetition; `CI95` is a bootstrap interval (bench/stats.py: repetitions and "
        "paired sessions resampled, seeded) of the median ratio; `W/L` counts the repetitions whose ratio was "
        "below / above 1.",
        "",
    ]
    extra: dict[str, Any] = {}
    if repeats is not None:
        agg = [r["aggregate"] | {"name": r["name"]} for r in rows if "aggregate" in r]
        flat = repetition_rows(repeats)
        extra = {"repetitions": flat}
        lines += [
            f"## Medians over {len(repeats)} repetitions",
            "",
            "Configurations ran interleaved (the order rotates by one each repetition, `pos` below), so drift in "
            "machine load hits all of them alike. Absolute columns: median over the repetitions where the "
            "configuration ran. Ratio columns (`/RO` = vs Round-only): the ratio is computed *within* each "
            "repetition, then the median of those ratios is shown with their min-max range in brackets. "
            "`SCT p50 range s`: min-max of the absolute SCT p50 over repetitions (the run-to-run spread).",
            "",
            "```",
            repeats_table(agg),
            "```",
            "",
        ]
        abl = ablations_table(agg, baseline_names(rows))
        if abl:
            lines += [
                "### Each configuration against Talaria",
                "",
                "Per repetition the configuration's SCT percentile over Talaria's on the same sessions; median "
                "[min-max] over repetitions, the bootstrap CI95 of that median, `W/L` = repetitions below / above 1. "
                "For an ablation (one mechanism off) `off helps` means turning the mechanism off made sessions faster "
                "beyond the noise (the whole interval below 1), `pays` that the mechanism made them faster (above 1), "
                "`tie` that the interval holds 1.",
                "",
                "```",
                abl,
                "```",
                "",
            ]
        lc = lease_comparison(repeats)
        if lc:
            extra["lease_comparison"] = lc
            lines += [
                "### Lease policies against the best fixed tau (issue 14)",
                "",
                f"The lease rows over the {lc['repetitions']} repetitions where all of them ran: geometric means of SCT p50 / p95, "
                "means of the lease counters (`token x s` = committed tokens x seconds held by leases: the device KV they "
                "reserved). Below, each row that is not a fixed tau against the best fixed tau (best by the geometric "
                "mean; p95 against the best p95), paired per repetition: the geometric mean of the per-repetition "
                "ratios with its 95 % Student t interval. The goal: an adaptive row matches or beats the best fixed tau "
                "on both (neither interval above 1) with less KV than the best-p50 fixed tau.",
                "",
                "```",
                lease_table(lc),
                "```",
                "",
            ]
        lines += [
            "### Per repetition",
            "",
            "```",
            repetitions_table(flat),
            "```",
            "",
            "The detailed table and the plots below show, per configuration, its **median repetition** (the one "
            "whose SCT p50 is the median of its repetitions; `plot_repetition` in each section), not pooled "
            "samples; the ratio columns of the detailed table are the medians of the per-repetition ratios.",
            "",
        ]
    lines += [
        "```",
        table,
        "```",
        "",
        "Columns and where each number comes from:",
        "",
        "| column | source |",
        "|---|---|",
    ]
    for h, _k, src in COLUMNS:
        lines.append(f"| {h} | {src} |")
    lines += [
        "",
        "Sources: " + "; ".join(f"**{k}** = {v}" for k, v in SOURCES.items()) + ".",
        "",
        "SCT = end of a session's last response - intended enqueue of its first call; TTFT is schedule-aware "
        "(from the intended enqueue time, so admission delay counts); percentiles are nearest-rank. "
        "`switch share` is the share of round wall time spent switching from round records (telemetry) when "
        "engines publish them; a value marked `*` is a proxy: switch seconds from engine switch records / "
        "(cold instances x replay wall). `KV hits dev/host`: calls whose prefix came from device KV / calls that "
        "restored prompt tokens from the host KV store, exact per call from the usage the client received "
        "(`prompt_tokens_details.restored_tokens`; token counts by source in `kv_hit_tokens_by_source`, and "
        "`kv_hits_source` = `usage`). When the responses lack `restored_tokens` the cell is an estimate marked `~` "
        "(`kv_hits_source` = `estimate`): calls with cached prompt tokens (client; device and host-restored alike) "
        "/ host restores (kvstore Stats). "
        "`engaged` shows whether each mechanism actually ran: round records received (slot scheduler / SP), bytes "
        "checkpointed into the kvstore (HKVR), switches that used staged weights of all switches (D2D).",
        "",
    ]
    lines += [
        "## Where a call's time goes",
        "",
        "Mean seconds per completed call of each component, as recorded per call by the router and engines "
        "(telemetry call records; `bench/report.py` `LATENCY_COMPONENTS` lists the fields read). `not recorded`: "
        "no call record of this build carries the component — it is not estimated. `unattributed`: the part of "
        "the mean call latency (router arrival to end) the recorded components do not cover.",
        "",
        "```",
        latency_table(rows),
        "```",
        "",
    ]
    for r in rows:
        lines.append(f"## {r['name']}")
        lines.append("")
        lines.append(f"{r.get('description', '')}")
        lines.append("")
        if not r.get("summary"):
            lines.append(f"Status: {r.get('status', 'n/a')}")
            lines.append("")
            continue
        s = r["summary"]
        if r.get("plot_repetition"):
            lines.append(f"Median repetition shown: {r['plot_repetition']} (SCT p50 per repetition: "
                         f"{', '.join(f'{v:.2f}s' for v in r['aggregate']['metrics']['sct_p50_s']['values'])})"
                         + (f"; failed repetitions: {r['failed_repetitions']}" if r.get("failed_repetitions") else ""))
            lines.append("")
        if (s.get("latency_split") or {}).get("by_placement"):
            lines += ["Time split by placement (mean seconds per call; reason / lease / predicted KV source / model switch):", "",
                      "```", placement_split_table(s["latency_split"]), "```", ""]
        keys = [k for k in s if k not in ("scts", "ttfts")]
        lines.append("```")
        lines.append(json.dumps({k: s[k] for k in keys}, indent=1, default=str))
        lines.append("```")
        lines.append("")
    for name, path in plots.items():
        lines.append(f"![{name}]({path.name})")
        lines.append("")
    if not plots:
        lines.append("(plots skipped: matplotlib is not installed)")
    p = out / "README.md"
    p.write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows, **extra}, indent=1, default=_json_default))
    return p


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def write_single_report(out: Path, summary: dict[str, Any], res) -> Path:
    """``talaria bench replay``: the summary of one replay (no configuration matrix)."""
    rows = [{"name": "replay", "summary": summary, "description": "one replay against a running stack"}]
    return write_matrix_report(out, rows, {"command": "talaria bench replay", "workload_desc": json.dumps(res.meta.get("workload", {}))})


def _plots(out: Path, rows: list[dict[str, Any]]) -> dict[str, Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    ran = [r for r in rows if r.get("summary")]
    if not ran:
        return {}
    paths: dict[str, Path] = {}
    for key, label, fname in (("scts", "session completion time (s)", "sct_cdf.png"), ("ttfts", "schedule-aware TTFT (s)", "ttft_cdf.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for r in ran:
            vals = r["summary"][key]
            xs = sorted(vals.values() if isinstance(vals, dict) else vals)
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=r["name"])
        if all(v > 0 for r in ran for v in (r["summary"][key].values() if isinstance(r["summary"][key], dict) else r["summary"][key])):
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths[f"CDF of {label}"] = out / fname
    # per-session scatter: one column per configuration, one point per session, sessions linked by colour
    sessions = sorted({sid for r in ran for sid in r["summary"]["scts"]})
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(ran) + 2), 4.2))
    cmap = plt.get_cmap("tab20")
    for si, sid in enumerate(sessions):
        xs, ys = [], []
        for ci, r in enumerate(ran):
            v = r["summary"]["scts"].get(sid)
            if v is not None:
                xs.append(ci + (si - len(sessions) / 2) * 0.3 / max(1, len(sessions)))
                ys.append(v)
        ax.plot(xs, ys, "o-", color=cmap(si % 20), alpha=0.6, lw=0.6, ms=4)
    ax.set_xticks(range(len(ran)), [r["name"] for r in ran], rotation=20, fontsize=8)
    ax.set_ylabel("SCT per session (s)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "sct_per_session.png", dpi=110)
    plt.close(fig)
    paths["SCT per session"] = out / "sct_per_session.png"
    split = _latency_plot(plt, out, ran)
    if split is not None:
        paths["call latency split (mean per call)"] = split
    return paths


def _latency_plot(plt, out: Path, ran: list[dict[str, Any]]) -> Path | None:
    """Stacked bars, one per configuration: the recorded components and the unattributed rest."""
    splits = [(r["name"], r["summary"].get("latency_split") or {}) for r in ran]
    splits = [(n, ls) for n, ls in splits if ls.get("calls")]
    if not splits:
        return None
    names = [n for n, _k in LATENCY_COMPONENTS]
    recorded = [n for n in names if any(ls["components"].get(n) is not None for _c, ls in splits)]
    fig, ax = plt.subplots(figsize=(max(6.4, 1.2 * len(splits) + 3), 4.4))
    cmap = plt.get_cmap("tab10")
    bottoms = [0.0] * len(splits)
    for i, comp in enumerate(recorded + ["unattributed"]):
        vals = [(ls.get("unattributed_s") if comp == "unattributed" else ls["components"].get(comp)) or 0.0 for _c, ls in splits]
        vals = [v if _finite(v) else 0.0 for v in vals]
        ax.bar(range(len(splits)), vals, bottom=bottoms, label=comp, color="lightgrey" if comp == "unattributed" else cmap(i % 10),
               hatch="//" if comp == "unattributed" else None)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    missing = [n for n in names if n not in recorded]
    ax.set_xticks(range(len(splits)), [c for c, _ls in splits], rotation=20, fontsize=8)
    ax.set_ylabel("mean seconds per call")
    import textwrap

    ax.set_title(textwrap.fill("not recorded: " + ", ".join(missing), 90) if missing else "all components recorded", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    p = out / "latency_split.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


# --------------------------------------------------------------------------- repetitions (--repeats)
# Absolute times on the shared 2-core machine drift by tens of percent between runs, so a claim rests on
# repetitions: configurations run interleaved (bench/matrix.py), every ratio is computed *within* one
# repetition (both sides saw the same machine state), and the report gives the median over repetitions
# and the min-max range of those per-repetition ratios.
REPEAT_METRICS = ("sct_p50_s", "sct_p95_s", "ttft_p50_s", "ttft_p95_s")
LEASE_COUNTS = ("lease_hits", "leases_unused", "lease_expiries", "leases_declined", "lease_outweighed", "lease_token_s")  # issue 14
REPEAT_RATIOS = tuple(f"{m}_{q}_vs_{ref}" for ref in ("base", "talaria", "best") for m in ("sct", "ttft") for q in ("p50", "p95"))
CI_RATIOS = ("sct_p50_vs_base", "sct_p95_vs_base", "sct_p50_vs_best", "sct_p95_vs_best")  # bootstrap intervals (bench/stats.py)
VS_REFERENCE = ("sct_p50_vs_talaria", "sct_p95_vs_talaria")  # every other row / the reference (Talaria): the ablations' verdicts


def _median(xs: list[float]) -> float:
    import statistics

    return float(statistics.median(xs)) if xs else NA


def aggregate_repeats(reps: list[list[dict[str, Any]]], baseline: str = "Round-only", reference: str = "Talaria") -> list[dict[str, Any]]:
    """One entry per configuration from ``reps`` (``reps[i]`` = the rows of repetition ``i``: name, status,
    summary). Ratios vs ``baseline`` / ``reference`` are computed within each repetition (``add_ratios``,
    which sets them on the summaries), then summarized: median and min-max over the repetitions where both
    sides ran. Metrics: median and min-max over the repetitions where the configuration ran. ``median_rep``
    is the repetition whose SCT p50 is the (lower) median of this configuration's: its distributions are
    the ones plotted."""
    for rows in reps:
        add_ratios(rows, baseline, reference)
    names: list[str] = []
    for rows in reps:
        names += [r["name"] for r in rows if r["name"] not in names]
    out = []
    for name in names:
        per = [(i, r) for i, rows in enumerate(reps) for r in rows if r["name"] == name]
        ok = [(i, r["summary"]) for i, r in per if r.get("summary")]
        agg: dict[str, Any] = {"name": name, "repeats": len(per), "repeats_ok": len(ok), "metrics": {}, "ratios": {}}
        for k in REPEAT_METRICS:
            vals = [s[k] for _i, s in ok if _finite(s.get(k))]
            agg["metrics"][k] = {"median": _median(vals), "min": min(vals, default=NA), "max": max(vals, default=NA), "values": vals}
        for k in REPEAT_RATIOS:
            vals = [s[k] for _i, s in ok if _finite(s.get(k))]
            agg["ratios"][k] = {"median": _median(vals), "min": min(vals, default=NA), "max": max(vals, default=NA), "n": len(vals), "values": vals}
        agg["ci95"] = _repeat_cis(reps, name, baseline, reference)
        agg["wins_losses"] = {k: list(wins_losses(agg["ratios"][k]["values"])) for k in CI_RATIOS + VS_REFERENCE}
        loads = [v[0] for _i, s in ok for key in ("loadavg_before", "loadavg_after") if (v := s.get(key))]
        agg["load1"] = {"min": min(loads, default=NA), "max": max(loads, default=NA), "values": loads}
        agg["calls_failed_total"] = sum(int(s.get("calls_failed", 0)) for _i, s in ok)
        agg["engine_cpu_s"] = _median([s["engine_cpu_s"] for _i, s in ok if _finite(s.get("engine_cpu_s"))])
        gemm = [m["gemm_gflops"] for _i, s in ok if (m := s.get("machine"))]
        agg["machine_gemm_gflops"] = {"min": min(gemm, default=NA), "max": max(gemm, default=NA), "values": gemm}
        ranked = sorted(((s["sct_p50_s"], i) for i, s in ok if _finite(s.get("sct_p50_s"))))
        agg["median_rep"] = ranked[(len(ranked) - 1) // 2][1] if ranked else (ok[0][0] if ok else None)
        agg["statuses"] = [r.get("status", "ok" if r.get("summary") else "n/a") for _i, r in per]
        out.append(agg)
    return out


def _repeat_cis(reps: list[list[dict[str, Any]]], name: str, baseline: str, reference: str = "Talaria") -> dict[str, list[float]]:
    """Hierarchical bootstrap intervals (repetitions, then paired sessions; bench/stats.py) of the
    configuration's median-over-repetitions SCT ratios vs ``baseline``, vs the best baseline and vs
    ``reference`` (not for the reference itself: an ablation's interval vs Talaria says whether turning
    its mechanism off helps by more than the noise, issue 12's done-when)."""
    from bench.stats import bootstrap_ratio_ci

    vs_base, vs_best, vs_ref = [], [], []
    for rows in reps:
        by = {r["name"]: r["summary"] for r in rows if r.get("summary")}
        if name not in by:
            continue
        if baseline in by:
            vs_base.append((by[name]["scts"], [by[baseline]["scts"]]))
        dens = [by[n]["scts"] for n in baseline_names(rows, baseline) if n in by]
        if dens:
            vs_best.append((by[name]["scts"], dens))
        if name != reference and reference in by:
            vs_ref.append((by[name]["scts"], [by[reference]["scts"]]))
    out = {}
    for key, pairs in (("base", vs_base), ("best", vs_best), ("talaria", vs_ref)):
        if key == "talaria" and not pairs:
            continue
        for q, qn in ((50, "p50"), (95, "p95")):
            out[f"sct_{qn}_vs_{key}"] = list(bootstrap_ratio_ci(pairs, q, seed=CI_SEED))
    return out


def repetition_rows(reps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The per-repetition table (JSON and Markdown): one flat row per (repetition, configuration)."""
    flat = []
    for i, rows in enumerate(reps):
        for r in rows:
            s = r.get("summary") or {}
            row = {"rep": i + 1, "position": r.get("position"), "name": r["name"], "status": r.get("status", "")}
            row.update({k: s.get(k, NA) for k in REPEAT_METRICS + REPEAT_RATIOS})
            row["calls_failed"] = s.get("calls_failed", NA)
            row["replay_wall_s"] = s.get("wall_s", NA)
            row["sessions_won_lost_tied_vs_base"] = s.get("sessions_won_lost_tied_vs_base")
            row["loadavg_before"], row["loadavg_after"] = s.get("loadavg_before"), s.get("loadavg_after")
            if r.get("kind") == "lease":  # issue 14: the lease counters of each repetition, for re-reading the comparison
                row.update({k: s.get(k, NA) for k in LEASE_COUNTS})
            flat.append(row)
    return flat


def _ratio_cell(r: dict[str, Any]) -> str:
    if not _finite(r["median"]):
        return "n/a"
    return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"


def _ci_range(ci: Any) -> str:
    return f"{ci[0]:.2f}-{ci[1]:.2f}" if ci and all(_finite(x) for x in ci) else "n/a"


def _ratio_ci_wl(a: dict[str, Any], key: str) -> list[str]:
    """The three cells of one aggregated ratio: median [min-max], its CI95, W/L."""
    w = a.get("wins_losses", {}).get(key)
    return [_ratio_cell(a["ratios"][key]), _ci_range(a.get("ci95", {}).get(key)), f"{w[0]}/{w[1]}" if w else "n/a"]


def _range_cell(r: dict[str, Any] | None, digits: int) -> str:
    """``min-max`` of an aggregate's range with ``digits`` decimals, or n/a where it has no finite minimum."""
    return f"{r['min']:.{digits}f}-{r['max']:.{digits}f}" if r and _finite(r.get("min", NA)) else "n/a"


def repeats_table(agg: list[dict[str, Any]], baseline: str = "Round-only") -> str:
    """Medians over repetitions; ratio columns: median of the per-repetition ratios [min-max]; ``CI95``: the
    hierarchical bootstrap interval of that median (bench/stats.py); ``W/L``: repetitions whose ratio was
    below / above 1; ``load 1m``: min-max of the 1-minute load average around this configuration's runs; ``GEMM GF/s``:
    min-max of the machine's bf16 GEMM rate probed before them (bench/machine.py)."""
    b = "RO" if baseline == "Round-only" else baseline
    headers = ["configuration", "ok/reps", "SCT p50 s", "SCT p95 s", "TTFT p50 s", "TTFT p95 s",
               f"SCT p50/{b}", f"SCT p95/{b}", f"TTFT p50/{b}", f"TTFT p95/{b}",
               "SCT p50/best", "CI95", "W/L", "SCT p95/best", "CI95", "W/L", "SCT p50 range s", "engine CPU s", "load 1m",
               "GEMM GF/s", "failed"]
    body = []
    for a in agg:
        m, q = a["metrics"], a["ratios"]
        best = _ratio_ci_wl(a, "sct_p50_vs_best") + _ratio_ci_wl(a, "sct_p95_vs_best")
        body.append([a["name"], f"{a['repeats_ok']}/{a['repeats']}"] + [m[k]["median"] for k in REPEAT_METRICS]
                    + [_ratio_cell(q[k]) for k in ("sct_p50_vs_base", "sct_p95_vs_base", "ttft_p50_vs_base", "ttft_p95_vs_base")]
                    + best
                    + [_range_cell(m["sct_p50_s"], 1),
                       f"{a['engine_cpu_s']:.1f}" if _finite(a.get("engine_cpu_s", NA)) else "n/a",
                       _range_cell(a.get("load1"), 2), _range_cell(a.get("machine_gemm_gflops"), 0), a["calls_failed_total"]])
    return format_table(headers, body)


def ablation_verdict(ci: Any) -> str:
    """One quantile's verdict on a configuration / Talaria interval: ``off helps`` when the whole interval is
    below 1 (the configuration beats Talaria beyond the noise), ``pays`` when it is above 1, else ``tie``."""
    if not ci or not all(_finite(x) for x in ci):
        return "n/a"
    return "off helps" if ci[1] < 1.0 else "pays" if ci[0] > 1.0 else "tie"


def ablations_table(agg: list[dict[str, Any]], skip: Iterable[str], reference: str = "Talaria") -> str:
    """Every configuration but ``reference`` and ``skip`` (the baselines) against ``reference``, paired within
    each repetition: median ratio [min-max], its bootstrap CI95, W/L (repetitions below / above 1), and per
    quantile the verdict of ``ablation_verdict`` (for an ablation row: whether the mechanism it turns off
    earns its place). Empty when ``reference`` did not run."""
    if not any(a["name"] == reference for a in agg):
        return ""
    headers = ["configuration", "SCT p50/" + reference, "CI95", "W/L", "p50", "SCT p95/" + reference, "CI95", "W/L", "p95"]
    body = []
    skip = set(skip) | {reference}
    for a in agg:
        if a["name"] in skip:
            continue
        row: list[object] = [a["name"]]
        for k in VS_REFERENCE:
            row += _ratio_ci_wl(a, k) + [ablation_verdict(a.get("ci95", {}).get(k))]
        body.append(row)
    return format_table(headers, body) if body else ""


def lease_comparison(reps: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Issue 14's lease rows (``lease-fixed-*``, ``lease-adaptive*``, ``no-leases``) read the way ``talaria sim
    leases`` reads its seeds, with the repetition as the unit: per row the geometric mean over repetitions of
    SCT p50 / p95 and the mean of the lease counters (``lease_token_s`` = committed tokens x seconds held by
    leases, the device KV they reserved), and every other row against the best fixed tau, paired per
    repetition (``bench.stats.vs_best_fixed``; ``goal_met`` is the issue's goal for an adaptive row). Only
    repetitions where every lease row ran are used. ``{}`` without a fixed row and one other lease row. Pure."""
    names = [r["name"] for r in reps[0]] if reps else []
    lease = [n for n in names if n.startswith(("lease-fixed-", "lease-adaptive")) or n == "no-leases"]
    fixed = [n for n in lease if n.startswith("lease-fixed-")]
    if not fixed or len(lease) == len(fixed):
        return {}
    units = [{r["name"]: r["summary"] for r in rep if r["name"] in lease and r.get("status") == "ok" and r.get("summary")} for rep in reps]
    units = [u for u in units if len(u) == len(lease) and all(_finite(u[n].get("sct_p50_s")) for n in lease)]
    if not units:
        return {}
    keys = ("sct_p50_s", "sct_p95_s") + LEASE_COUNTS
    per_unit = {n: [{k: float(u[n].get(k) or 0.0) if _finite(u[n].get(k)) else 0.0 for k in keys} for u in units] for n in lease}
    rows = {n: unit_means(rs, keys) for n, rs in per_unit.items()}
    vs = {n: vs_best_fixed(rows, n, fixed, per_unit, kv_key="lease_token_s") for n in lease if n not in fixed}
    return {"repetitions": len(units), "rows": rows, "vs_best_fixed": vs}


def lease_table(cmp: dict[str, Any]) -> str:
    """``lease_comparison`` as text: the rows, then each non-fixed row's paired ratios against the best fixed tau."""
    if not cmp:
        return ""
    head = ["configuration", "SCT p50 s", "SCT p95 s", "hits", "unused", "expiries", "declined", "outweighed", "token x s"]
    body = [[n, f"{r['sct_p50_s']:.2f}", f"{r['sct_p95_s']:.2f}"] + [f"{r[k]:.0f}" for k in LEASE_COUNTS] for n, r in cmp["rows"].items()]
    lines = [format_table(head, body), ""]
    for n, c in cmp["vs_best_fixed"].items():
        if not c:
            continue
        cells = []
        for q in ("p50", "p95"):
            p = c.get(f"paired_sct_{q}_vs_best") or {}
            cells.append(f"SCT {q} {p['ratio']:.3f}x [{p['lo']:.3f}-{p['hi']:.3f}] of {c[f'best_fixed_{q}']} ({p['wins']}/{p['n']} better)"
                         if p else f"SCT {q} {c[f'sct_{q}_vs_best']:.3f}x of {c[f'best_fixed_{q}']}")
        kv = c["kv_vs_best"]
        lines.append(f"{n}: " + ", ".join(cells) + f", KV {kv:.2f}x" + (f"; goal met: {c['goal_met']}, beats: {c.get('beats')}" if n.startswith("lease-adaptive") else ""))
    return "\n".join(lines)


def repetitions_table(flat: list[dict[str, Any]]) -> str:
    headers = ["rep", "pos", "configuration", "SCT p50 s", "SCT p95 s", "TTFT p50 s", "TTFT p95 s", "SCT p50/RO", "SCT p95/RO",
               "TTFT p50/RO", "SCT p50/best", "SCT p95/best", "sessions W/L/T vs RO", "load 1m", "failed", "status"]
    body = [[r["rep"], r["position"] if r["position"] is not None else "-", r["name"]] + [r[k] for k in REPEAT_METRICS]
            + [r[k] for k in ("sct_p50_vs_base", "sct_p95_vs_base", "ttft_p50_vs_base", "sct_p50_vs_best", "sct_p95_vs_best")]
            + ["/".join(map(str, r["sessions_won_lost_tied_vs_base"])) if r.get("sessions_won_lost_tied_vs_base") else "n/a",
               _load_cell(r), r["calls_failed"], r["status"]]
            for r in flat]
    return format_table(headers, body)


def combine_repeats(reps: list[list[dict[str, Any]]], baseline: str = "Round-only", reference: str = "Talaria") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows for the detailed report from ``reps``: each configuration's row carries the summary of its median
    repetition (its CDFs are plotted) with the ratio keys replaced by the medians of the per-repetition
    ratios, plus ``aggregate`` (``aggregate_repeats``). Returns (rows, aggregate)."""
    agg = aggregate_repeats(reps, baseline, reference)
    rows = []
    for a in agg:
        per = {i: r for i, rr in enumerate(reps) for r in rr if r["name"] == a["name"]}
        first = next(iter(per.values()))
        row = {k: v for k, v in first.items() if k not in ("summary", "status", "position", "logs")}
        if a["median_rep"] is None:
            row["status"] = first.get("status", "n/a")
        else:
            src = per[a["median_rep"]]
            row["status"] = "ok"
            s = dict(src["summary"])
            for k in REPEAT_RATIOS:
                s[k] = a["ratios"][k]["median"]
            for k, ci in a.get("ci95", {}).items():
                s[f"{k}_ci"] = ci
            row["summary"] = s
            row["plot_repetition"] = a["median_rep"] + 1
        failed = [st for st in a["statuses"] if st != "ok"]
        if failed:
            row["failed_repetitions"] = failed
        row["aggregate"] = {k: v for k, v in a.items() if k != "name"}
        rows.append(row)
    return rows, agg
