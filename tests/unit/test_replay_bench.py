"""Fixed-replay benchmark (issue 8): workloads (format, generator distributions, Mooncake import), the
closed-loop replay schedule, the report's metrics and the configuration matrix's knob handling. No server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import pytest

from bench.workloads import (
    Call,
    Session,
    TraceError,
    Workload,
    common_prefix,
    describe,
    nearest_rank,
    read_jsonl,
    resolve_prompts,
    write_jsonl,
)
from bench.workloads.synthetic import SynthParams, generate

# ------------------------------------------------------------------------------------ generator
def test_generator_matches_published_swe_bench_distributions():
    """Talaria §2.1: depth p50 11 / p95 49; gap p50 0.39 s / p95 1.32 s; prompt p50 25K / p95 105K tokens
    (x length_scale); 96.8 % of continuations reuse more than half of the prior prompt."""
    scale = 1 / 32
    w = generate(SynthParams(sessions=600, seed=0, length_scale=scale, max_prompt=10**9, max_output=10**9))
    d = describe(w)
    assert 10 <= d["depth_p50"] <= 12
    assert 40 <= d["depth_p95"] <= 58
    assert d["depth_max"] <= 187
    assert d["gap_p50_s"] == pytest.approx(0.39, rel=0.05)
    assert d["gap_p95_s"] == pytest.approx(1.32, rel=0.08)
    assert d["prompt_p50"] == pytest.approx(25_000 * scale, rel=0.06)
    assert d["prompt_p95"] == pytest.approx(105_000 * scale, rel=0.08)
    assert 0.955 <= d["reuse_over_half_share"] <= 0.98


def test_generator_is_seeded_and_continuations_are_true_prefix_extensions():
    a = generate(SynthParams(sessions=8, seed=3))
    b = generate(SynthParams(sessions=8, seed=3))
    c = generate(SynthParams(sessions=8, seed=4))
    assert [resolve_prompts(s) for s in a.sessions] == [resolve_prompts(s) for s in b.sessions]
    assert [resolve_prompts(s) for s in a.sessions] != [resolve_prompts(s) for s in c.sessions]
    for s in a.sessions:
        ps = resolve_prompts(s)
        assert s.calls[0].prefix_tokens == 0 and s.calls[0].gap_s == 0
        for i in range(1, len(ps)):
            assert common_prefix(ps[i - 1], ps[i]) == s.calls[i].prefix_tokens  # the recorded reuse is exact
            assert len(ps[i]) > s.calls[i].prefix_tokens  # every call has new tokens to prefill
            assert len(ps[i]) <= 3584 and all(3 <= t < 4096 for t in ps[i])
    assert {s.model for s in a.sessions} == {"tiny-llama", "tiny-qwen2", "tiny-qwen3"}
    offsets = [s.start_offset_s for s in a.sessions]
    assert offsets == sorted(offsets) and offsets[0] == 0.0


# ----------------------------------------------------------------------------------- format I/O
def test_trace_round_trip_and_validation(tmp_path):
    w = generate(SynthParams(sessions=4, seed=1, max_depth=5))
    p = write_jsonl(w, tmp_path / "w.jsonl")
    first = json.loads(p.read_text().splitlines()[0])
    assert first["meta"]["format"] == "talaria-replay/1" and first["meta"]["seed"] == 1
    r = read_jsonl(p)
    assert [s.session_id for s in r.sessions] == [s.session_id for s in w.sessions]
    assert [resolve_prompts(s) for s in r.sessions] == [resolve_prompts(s) for s in w.sessions]
    assert [s.start_offset_s for s in r.sessions] == pytest.approx([s.start_offset_s for s in w.sessions])

    # text and chat prompts are accepted too
    q = tmp_path / "text.jsonl"
    q.write_text(
        '{"session_id":"a","call_index":1,"model":"m","output_tokens":3,"gap_s":0.5,"prefix_tokens":2,"messages":[{"role":"user","content":"hi there"}]}\n'
        '{"session_id":"a","call_index":0,"model":"m","output_tokens":3,"prompt_text":"hello","start_offset_s":1.5}\n'
    )
    t = read_jsonl(q)
    assert [c.call_index for c in t.sessions[0].calls] == [0, 1] and t.sessions[0].start_offset_s == 1.5
    assert resolve_prompts(t.sessions[0])[1] == [{"role": "user", "content": "hi there"}]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id":"a","call_index":0,"model":"m","output_tokens":3,"prompt_text":"x","prompt_tokens":[5]}\n')
    with pytest.raises(TraceError, match="exactly one"):
        read_jsonl(bad)
    bad.write_text('{"session_id":"a","call_index":1,"model":"m","output_tokens":3,"prompt_text":"x"}\n')
    with pytest.raises(TraceError, match="call_index"):
        read_jsonl(bad)


def test_nearest_rank():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert nearest_rank(xs, 50) == 3.0  # rank ceil(2.5) = 3
    assert nearest_rank(xs, 95) == 5.0
    assert nearest_rank(xs, 20) == 1.0  # rank 1
    assert nearest_rank(list(range(1, 101)), 95) == 95
    assert math.isnan(nearest_rank([], 50))


# ------------------------------------------------------------------------------------- Mooncake
def test_mooncake_sessions_from_hash_chains():
    from bench.workloads.mooncake import derive_sessions

    recs = [
        {"timestamp": 0, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "hash_ids": [9, 10]},
        {"timestamp": 10, "hash_ids": [1, 2, 3, 4, 5]},  # extends #0
        {"timestamp": 20, "hash_ids": [1, 2, 3, 4, 5, 6]},  # extends #2
        {"timestamp": 30, "hash_ids": [1, 2, 7]},  # branches off an older turn: a new session
        {"timestamp": 40, "hash_ids": [1, 8]},  # one shared block only: a new session
        {"timestamp": 50, "hash_ids": [9, 10, 11]},  # extends #1
    ]
    assert derive_sessions(recs, 2) == [[0, 2, 3], [1, 6], [4], [5]]


def test_mooncake_import_scales_and_keeps_prefix_reuse(mooncake_trace):
    from bench.workloads.mooncake import MooncakeParams, import_mooncake

    w = import_mooncake(MooncakeParams(path=str(mooncake_trace), sessions=6, length_scale=1 / 16, time_scale=1 / 100))
    assert len(w.sessions) == 6 and all(len(s.calls) >= 2 for s in w.sessions)
    assert w.meta["length_scale"] == 1 / 16 and w.meta["block_tokens"] == 32
    for s in w.sessions:
        ps = resolve_prompts(s)
        for i in range(1, len(ps)):
            assert common_prefix(ps[i - 1], ps[i]) >= s.calls[i].prefix_tokens > 0
    assert describe(w)["reuse_over_half_share"] > 0.9


# ------------------------------------------------------------------------------- replay schedule
def _workload(gap_s: float) -> Workload:
    def sess(sid: str, offset: float, n: int) -> Session:
        calls = [Call(sid, 0, "m", 2, 0.0, 0, prompt_tokens=[5, 6, 7])]
        for i in range(1, n):
            calls.append(Call(sid, i, "m", 2, gap_s, 3 + (i - 1), append_tokens=[8 + i]))
        return Session(sid, offset, calls)

    return Workload([sess("a", 0.0, 3), sess("b", 0.15, 2)])


def test_replay_is_closed_loop_with_capped_gaps_and_offsets():
    from bench.replay import Outcome, replay

    seen: list[tuple[str, int, list[int]]] = []
    busy = {"a": 0, "b": 0}

    async def send(s, c, prompt, sent_at):
        busy[s.session_id] += 1
        assert busy[s.session_id] == 1  # never two calls of one session in flight
        seen.append((s.session_id, c.call_index, prompt))
        await asyncio.sleep(0.03)
        now = time.monotonic()
        busy[s.session_id] -= 1
        return Outcome(status=200, first_token=now - 0.01, last_token=now, end=now, instance="e0",
                       usage={"prompt_tokens": len(prompt), "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}})

    res = asyncio.run(replay(_workload(gap_s=5.0), send, gap_cap_s=0.1))
    by = {(c.session_id, c.call_index): c for c in res.calls}
    assert len(res.calls) == 5 and all(c.ok for c in res.calls)
    assert by[("a", 0)].intended == 0.0 and by[("b", 0)].intended == pytest.approx(0.15)
    for sid, n in (("a", 3), ("b", 2)):
        for i in range(1, n):
            prev, cur = by[(sid, i - 1)], by[(sid, i)]
            assert cur.gap_applied_s == 0.1  # 5 s recorded, capped
            assert cur.intended == pytest.approx(prev.end + 0.1)  # released after the previous ended + gap
            assert cur.sent >= cur.intended - 1e-3
    # prompts are the recorded prefix extensions, in call order per session
    assert [p for sid, _i, p in seen if sid == "a"] == [[5, 6, 7], [5, 6, 7, 9], [5, 6, 7, 9, 10]]
    assert by[("a", 2)].cached_tokens == 1 and by[("a", 2)].recorded_prefix_tokens == 4
    assert res.wall_s < 2.0


def test_replay_retries_overload_answers_without_moving_the_intended_time():
    from bench.replay import Outcome, replay

    attempts = {"n": 0}

    async def send(s, c, prompt, sent_at):
        attempts["n"] += 1
        now = time.monotonic()
        if attempts["n"] <= 2:
            return Outcome(status=429, error="http_429: busy", retry_after_s=0.02, end=now)
        return Outcome(status=200, first_token=now, last_token=now, end=now)

    w = Workload([Session("x", 0.0, [Call("x", 0, "m", 1, prompt_tokens=[4])])])
    res = asyncio.run(replay(w, send))
    c = res.calls[0]
    assert c.ok and c.retries == 2 and c.intended == 0.0 and c.ttft >= 0.04


# -------------------------------------------------------------------------------------- report
def test_summary_sct_ttft_and_ratios(tmp_path):
    from bench.replay import CallResult, ReplayResult
    from bench.report import add_ratios, matrix_table, summarize_run, write_matrix_report

    def run(scale: float) -> ReplayResult:
        calls = []
        for si in range(4):
            t = si * 1.0
            for k in range(2):
                c = CallResult(f"s{si}", k, "m", t, sent=t, first_token=t + 0.5 * scale, last_token=t + scale, end=t + scale,
                               status=200, instance="e0" if k == 0 or si % 2 else "e1", prompt_tokens=10, completion_tokens=2,
                               cached_tokens=5 * k, recorded_prefix_tokens=6 * k, recorded_output_tokens=2)
                calls.append(c)
                t += scale + 0.25
        return ReplayResult(calls, time.time(), 10.0)

    router_before = {"placement": {"avoidable_cold_opens": 1, "returns": 2, "same_instance_returns": 2}}
    router_after = {"placement": {"avoidable_cold_opens": 3, "returns": 6, "same_instance_returns": 5}}
    tel = {"router_before": router_before, "router_after": router_after, "switches": [{"total_seconds": 0.5, "path": "full_staged"}],
           "instances": 2, "records": [{"kind": "round", "wall_seconds": 2.0, "switch_seconds": 0.5, "sp_admitted": 3, "sp_deferred": 1}]}
    fast, slow = summarize_run(run(1.0), tel), summarize_run(run(2.0), {})
    # SCT of each session: 2 calls of `scale` plus one 0.25 s gap
    assert fast["sct_p50_s"] == pytest.approx(2.25) and slow["sct_p50_s"] == pytest.approx(4.25)
    assert fast["ttft_p50_s"] == pytest.approx(0.5)
    assert fast["avoidable_cold_opens"] == 2 and fast["same_instance_router"] == pytest.approx(0.75)
    assert fast["same_instance_client"] == pytest.approx(0.5)
    assert fast["switch_share_rounds"] == pytest.approx(0.25) and fast["sp_admitted"] == 3 and fast["sp_deferred"] == 1
    assert fast["kv_hit_calls"] == 4 and fast["reuse_captured"] == pytest.approx(5 / 6)
    assert math.isnan(slow["avoidable_cold_opens"]) and math.isnan(slow["sp_admitted"])  # no source: n/a, not 0
    rows = [{"name": "Talaria", "summary": fast}, {"name": "no-SP", "status": "not available (knob engines[].sp missing)"},
            {"name": "Round-only", "summary": slow}]
    add_ratios(rows)
    assert fast["sct_p50_vs_base"] == pytest.approx(2.25 / 4.25) and slow["sct_p50_vs_talaria"] == pytest.approx(4.25 / 2.25)
    table = matrix_table(rows)
    assert "no-SP: not available (knob engines[].sp missing)" in table and "3/1" in table
    md = write_matrix_report(tmp_path, rows, {"command": "x", "workload_desc": "y"})
    text = md.read_text()
    assert "nearest-rank" in text and "| SCT p50 s | client |" in text
    json.loads((tmp_path / "summary.json").read_text())


# -------------------------------------------------------------------------------------- matrix
def test_matrix_knobs_are_read_from_the_config_model():
    from bench.matrix import CONFIGS, apply_overrides, availability, knob_missing

    assert knob_missing("router.placement.policy", "least-pressure") is None
    assert "no value 'nonsense'" in knob_missing("router.placement.policy", "nonsense")
    assert knob_missing("engines[].no_such_knob", False) == "knob engines[].no_such_knob missing"
    assert knob_missing("engines[].kv_cache_mb", 8) is None
    by = {c.name: c for c in CONFIGS}
    assert set(by) >= {"Talaria", "no-SP", "no-HKVR", "H2D-only", "Round-only", "least-pressure", "session-sticky"}
    assert availability(by["Talaria"]) is None
    from talaria.config import EngineConfig

    for name, knob in (("no-SP", "sp"), ("no-HKVR", "host_kv"), ("H2D-only", "d2d_staging")):
        expect = None if knob in EngineConfig.model_fields else f"knob engines[].{knob} missing"
        assert availability(by[name]) == expect
    base = {"engines": [{"id": "a"}, {"id": "b"}], "router": {"port": 0}}
    out = apply_overrides(base, {"engines[].host_kv": False, "router.placement.policy": "session-sticky"})
    assert [e["host_kv"] for e in out["engines"]] == [False, False]
    assert out["router"] == {"port": 0, "placement": {"policy": "session-sticky"}} and "host_kv" not in base["engines"][0]


def test_cli_registers_replay_and_matrix():
    from bench.cli import add_cli

    p = argparse.ArgumentParser()
    add_cli(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["bench", "matrix", "--quick", "--configs", "Talaria", "no-HKVR", "--out", "o"])
    assert a.quick and a.configs == ["Talaria", "no-HKVR"] and a.out == "o" and a.repeats == 1
    assert p.parse_args(["bench", "matrix", "--repeats", "3"]).repeats == 3
    r = p.parse_args(["bench", "replay", "--api", "http://h:1", "--mooncake", "t.jsonl", "--sessions", "3"])
    assert (r.api, r.mooncake, r.sessions) == ("http://h:1", "t.jsonl", 3)


# ---------------------------------------------------------------------------- repetitions (--repeats)
def _rep(values: dict[str, tuple[float, float]], failed: tuple[str, ...] = ()) -> list[dict]:
    """One repetition's rows: name -> (SCT p50, TTFT p50); p95 = 2 x p50."""
    rows = []
    for name, (sct, ttft) in values.items():
        if name in failed:
            rows.append({"name": name, "status": "failed: RuntimeError: boom"})
            continue
        s = {"sct_p50_s": sct, "sct_p95_s": 2 * sct, "ttft_p50_s": ttft, "ttft_p95_s": 2 * ttft, "calls_failed": 0,
             "scts": {"s0": sct}, "ttfts": [ttft]}
        rows.append({"name": name, "status": "ok", "summary": s})
    return rows


def test_interleaved_orders_rotate_every_repetition():
    from bench.matrix import interleaved_orders

    assert interleaved_orders(["A", "B", "C", "D"], 1) == [["A", "B", "C", "D"]]
    assert interleaved_orders(["A", "B", "C", "D"], 3) == [["A", "B", "C", "D"], ["B", "C", "D", "A"], ["C", "D", "A", "B"]]
    orders = interleaved_orders(["A", "B", "C"], 3)
    assert all(sorted(o) == ["A", "B", "C"] for o in orders)
    assert [[o[i] for o in orders] for i in range(3)] == [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"]]  # each position once
    assert interleaved_orders([], 2) == [[], []]
    with pytest.raises(ValueError):
        interleaved_orders(["A"], 0)


def test_aggregate_repeats_takes_the_median_of_per_repetition_ratios():
    """The machine is 2x slower in repetition 2: absolute medians move, ratios computed within a repetition
    do not. The median of per-repetition ratios differs from the ratio of medians, and is what is reported."""
    from bench.report import aggregate_repeats

    reps = [
        _rep({"Talaria": (10.0, 1.0), "Round-only": (20.0, 2.0)}),  # ratio 0.5
        _rep({"Talaria": (30.0, 2.0), "Round-only": (40.0, 4.0)}),  # ratio 0.75 (slow machine)
        _rep({"Talaria": (12.0, 1.0), "Round-only": (16.0, 2.0)}),  # ratio 0.75
    ]
    agg = {a["name"]: a for a in aggregate_repeats(reps)}
    t, b = agg["Talaria"], agg["Round-only"]
    assert t["repeats"] == t["repeats_ok"] == 3
    assert t["metrics"]["sct_p50_s"]["median"] == 12.0 and b["metrics"]["sct_p50_s"]["median"] == 20.0
    assert (t["metrics"]["sct_p50_s"]["min"], t["metrics"]["sct_p50_s"]["max"]) == (10.0, 30.0)
    assert t["metrics"]["sct_p95_s"]["median"] == 24.0 and t["metrics"]["ttft_p95_s"]["median"] == 2.0
    r = t["ratios"]["sct_p50_vs_base"]
    assert r["values"] == [0.5, 0.75, 0.75] and r["median"] == 0.75 and (r["min"], r["max"]) == (0.5, 0.75)
    assert r["median"] != t["metrics"]["sct_p50_s"]["median"] / b["metrics"]["sct_p50_s"]["median"]  # not 12/20
    assert t["ratios"]["ttft_p50_vs_base"]["values"] == [0.5, 0.5, 0.5]
    assert b["ratios"]["sct_p50_vs_base"]["median"] == 1.0
    assert b["ratios"]["sct_p50_vs_talaria"]["values"] == [2.0, 40 / 30, 16 / 12]
    assert t["median_rep"] == 2 and b["median_rep"] == 0  # SCT p50 12 of (10, 30, 12); 20 of (20, 40, 16)


def test_aggregate_repeats_with_failed_and_even_repetitions():
    from bench.report import aggregate_repeats

    reps = [
        _rep({"Talaria": (10.0, 1.0), "no-SP": (9.0, 1.0), "Round-only": (20.0, 2.0)}),
        _rep({"Talaria": (11.0, 1.0), "no-SP": (9.0, 1.0), "Round-only": (10.0, 2.0)}, failed=("no-SP",)),
        _rep({"Talaria": (10.0, 1.0), "no-SP": (9.0, 1.0), "Round-only": (10.0, 2.0)}, failed=("Round-only",)),
        _rep({"Talaria": (10.0, 1.0), "no-SP": (27.0, 1.0), "Round-only": (30.0, 2.0)}),
    ]
    agg = {a["name"]: a for a in aggregate_repeats(reps)}
    t, n, b = agg["Talaria"], agg["no-SP"], agg["Round-only"]
    assert n["repeats"] == 4 and n["repeats_ok"] == 3 and n["statuses"][1].startswith("failed")
    # a ratio needs both sides in the same repetition: Talaria has 3 (rep 3 has no baseline), no-SP 2
    assert t["ratios"]["sct_p50_vs_base"]["values"] == [0.5, 1.1, 10 / 30]
    assert n["ratios"]["sct_p50_vs_base"]["values"] == [0.45, 0.9] and n["ratios"]["sct_p50_vs_base"]["median"] == pytest.approx(0.675)
    assert n["metrics"]["sct_p50_s"]["median"] == 9.0 and b["metrics"]["sct_p50_s"]["median"] == 20.0
    assert t["median_rep"] in (0, 2)  # lower median of an even count: an actual repetition, not an average
    assert b["median_rep"] == 0  # (20, 10, 30): sorted 10, 20, 30


def test_combine_repeats_report_and_json(tmp_path):
    from bench.report import combine_repeats, matrix_table, repeats_table, repetition_rows, write_matrix_report

    reps = [
        _rep({"Talaria": (10.0, 1.0), "no-SP": (0, 0), "Round-only": (20.0, 2.0)}, failed=("no-SP",)),
        _rep({"Talaria": (30.0, 2.0), "no-SP": (0, 0), "Round-only": (40.0, 4.0)}, failed=("no-SP",)),
        _rep({"Talaria": (12.0, 1.0), "no-SP": (0, 0), "Round-only": (16.0, 2.0)}, failed=("no-SP",)),
    ]
    for i, rows in enumerate(reps):
        for p, r in enumerate(rows):
            r["position"] = (p + i) % 3 + 1
    rows, agg = combine_repeats(reps)
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == ["Talaria", "no-SP", "Round-only"]
    t = by["Talaria"]
    assert t["status"] == "ok" and t["plot_repetition"] == 3 and t["summary"]["sct_p50_s"] == 12.0  # the median repetition
    assert t["summary"]["sct_p50_vs_base"] == 0.75  # the median of per-repetition ratios, not 12/16 of that repetition
    assert "summary" not in by["no-SP"] and by["no-SP"]["status"].startswith("failed")
    flat = repetition_rows(reps)
    assert len(flat) == 9 and flat[0]["rep"] == 1 and flat[3]["rep"] == 2 and flat[0]["sct_p50_vs_base"] == 0.5
    table = repeats_table(agg)
    assert "0.75 [0.50-0.75]" in table and "3/3" in table and "0/3" in table and "10.0-30.0" in table
    assert "no-SP" in matrix_table(rows)
    md = write_matrix_report(tmp_path, rows, {"command": "x", "workload_desc": "y", "repeats": 3}, repeats=reps).read_text()
    assert "Medians over 3 repetitions" in md and "### Per repetition" in md and "median repetition" in md
    data = json.loads((tmp_path / "summary.json").read_text())
    assert len(data["repetitions"]) == 9 and data["rows"][0]["aggregate"]["ratios"]["sct_p50_vs_base"]["median"] == 0.75


def test_matrix_has_the_issue_16_rows_and_they_are_available():
    from bench.matrix import CONFIGS, availability

    by = {c.name: c for c in CONFIGS}
    for name in ("+token-deadlines", "+unified-residency", "+partial-layers", "+JointServe+Aegaeon"):
        assert by[name].kind == "ablation" and availability(by[name]) is None
    assert by["+JointServe+Aegaeon"].overrides == {"engines[].token_deadlines": True, "engines[].unified_residency": True, "engines[].partial_layers": True}


def test_group_cpu_seconds_counts_the_work_of_a_process_group():
    """Issue 12: the matrix records the CPU seconds each service used (work, not wall time): a child in its own
    session that burns 0.3 s of CPU in a helper process of its group is counted in full (the idle group
    leader too), and a group no process can have is 0."""
    import subprocess
    import sys

    from bench.matrix import group_cpu_seconds

    burn = ("import time, subprocess, sys\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass\\ntime.sleep(30)'])\n"
            "print('started', flush=True); time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", burn], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60
        while group_cpu_seconds(p.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_cpu_seconds(p.pid) >= 0.3
    finally:
        import os
        import signal

        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert group_cpu_seconds(int(Path("/proc/sys/kernel/pid_max").read_text()) + 1) == 0.0
