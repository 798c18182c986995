"""Issue 12 items 5-6 and issue 14 workloads: honest baselines, the mini-swe-agent importer, two-model and
per-tool synthetic sessions, the `tool` field, bootstrap intervals, wins/losses and load averages."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from pathlib import Path

import pytest

from bench.workloads import Call, Session, TraceError, Workload, read_jsonl, resolve_prompts, write_jsonl



# ----------------------------------------------------------------------------------- tool field
def test_tool_field_round_trips_and_old_files_stay_readable(tmp_path):
    w = Workload([Session("s", 0.0, [Call("s", 0, "m", 2, prompt_tokens=[5, 6]),
                                     Call("s", 1, "m", 2, 0.3, 2, append_tokens=[7], tool="pytest")])])
    back = read_jsonl(write_jsonl(w, tmp_path / "w.jsonl"))
    assert [c.tool for c in back.sessions[0].calls] == [None, "pytest"]
    assert '"tool"' not in (tmp_path / "w.jsonl").read_text().splitlines()[1]  # absent, not null, when unknown
    old = tmp_path / "old.jsonl"  # a file written before the field existed
    old.write_text('{"session_id":"a","call_index":0,"model":"m","output_tokens":1,"prompt_tokens":[4]}\n')
    assert read_jsonl(old).sessions[0].calls[0].tool is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id":"a","call_index":0,"model":"m","output_tokens":1,"prompt_tokens":[4],"tool":3}\n')
    with pytest.raises(TraceError, match="tool must be a string"):
        read_jsonl(bad)


# ---------------------------------------------------------------------------- mini-swe-agent
def test_tool_of_reads_the_command_the_response_ran():
    from bench.workloads.miniswe import tool_of

    assert tool_of("THOUGHT: look\n\n```bash\ngrep -r foo .\n```") == "grep"
    assert tool_of("```bash\ncd /testbed && python -m pytest tests/x.py\n```") == "python"
    assert tool_of("```bash\nFOO=1 /usr/bin/pytest -x\n```") == "pytest"
    assert tool_of("```bash\nls\n```\nthen\n```bash\nsudo sed -i s/a/b/ f.py\n```") == "sed"  # the last block runs
    assert tool_of("no command, the final answer") is None


def _write_miniswe(path: Path) -> None:
    """Two sessions in scrambled order; inputs grow append-only; the second session starts an hour later."""
    a0 = "TASK: fix the bug in module x " * 4
    a1 = a0 + "OBSERVATION: x.py found " * 3
    a2 = a1 + "OBSERVATION: tests fail " * 3
    b0 = "TASK: another repository entirely " * 4
    recs = [
        {"timestamp": 3_000_000, "input": a2, "output": "done", "session_id": "A"},
        {"timestamp": 0, "input": a0, "output": "look\n```bash\nfind . -name x.py\n```", "session_id": "A"},
        {"timestamp": 3_600_000_000, "input": b0, "output": "```bash\nls\n```", "session_id": "B"},
        {"timestamp": 1_500_000, "input": a1, "output": "run\n```bash\ncd /t && pytest -q\n```", "session_id": "A"},
    ]
    with gzip.open(path, "wt") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def test_miniswe_import_rebuilds_prompts_gaps_and_tools(tmp_path):
    from bench.workloads.miniswe import MiniSweParams, import_miniswe, text_tokens

    src = tmp_path / "t.jsonl.gz"
    _write_miniswe(src)
    p = MiniSweParams(path=str(src), length_scale=1 / 2, models=("m1",), mean_interarrival_s=None)
    w = import_miniswe(p)
    assert [len(s.calls) for s in w.sessions] == [3, 1] and p.chars_per_token == 8
    a = w.sessions[0]
    assert [c.call_index for c in a.calls] == [0, 1, 2]  # sorted by timestamp, not file order
    assert [c.gap_s for c in a.calls] == [0.0, 1.5, 1.5]
    assert [c.tool for c in a.calls] == [None, "find", "pytest"]  # the tool the *previous* call ran
    prompts = resolve_prompts(a)
    for prev, cur, c in zip(prompts, prompts[1:], a.calls[1:]):
        assert cur[: len(prev)] == prev and c.prefix_tokens == len(prev)  # a true prefix extension
    # call 1's prompt = input 0 + output 0 + the observation: the response sits in between
    out0 = text_tokens("look\n```bash\nfind . -name x.py\n```", 8, 0, p.vocab)
    assert prompts[1][len(prompts[0]) : len(prompts[0]) + len(out0)] == out0
    assert a.calls[0].output_tokens == len(out0)
    assert w.sessions[1].start_offset_s == pytest.approx(3600.0)  # recorded offsets when asked for
    # default: a seeded Poisson start process (the recorded sessions ran one after another)
    w2 = import_miniswe(MiniSweParams(path=str(src), length_scale=1 / 2))
    assert w2.sessions[1].start_offset_s < 60 and "Poisson" in w2.meta["session_starts"]
    assert import_miniswe(MiniSweParams(path=str(src), length_scale=1 / 2)).sessions[1].start_offset_s == w2.sessions[1].start_offset_s
    # a session is cut before the first prompt over max_prompt, and the cut is stated
    short = import_miniswe(MiniSweParams(path=str(src), length_scale=1 / 2, max_prompt=len(prompts[1])))
    assert len(short.sessions[0].calls) == 2 and short.meta["calls_dropped"] == 1


def test_miniswe_import_of_the_public_trace_matches_its_readme(miniswe_trace):
    from bench.workloads import describe
    from bench.workloads.miniswe import MiniSweParams, import_miniswe

    w = import_miniswe(MiniSweParams())  # no path: the resolver finds the file the fixture found
    assert w.meta["source"].startswith(f"mini-swe-agent trace {miniswe_trace.name}")
    d = describe(w)
    assert (d["sessions"], d["calls"], d["depth_max"]) == (20, 402, 30)
    assert 250 <= d["prompt_p50"] <= 400  # ~5.2K tokens x 1/16
    assert d["reuse_over_half_share"] > 0.95 and w.meta["calls_dropped"] == 0
    tools = [c.tool for s in w.sessions for c in s.calls[1:]]
    assert sum(t is not None for t in tools) / len(tools) > 0.9 and {"grep", "find", "python", "sed"} <= set(tools)


# ---------------------------------------------------------------------------------- synthetic
def test_synthetic_default_is_unchanged_by_the_new_options():
    from bench.workloads.synthetic import SynthParams, generate

    w = generate(SynthParams(sessions=10, max_depth=20))
    assert w.num_calls == 152  # the matrix default's documented size at seed 0 (README)
    assert all(c.tool is None for s in w.sessions for c in s.calls)
    assert all(len({c.model for c in s.calls}) == 1 for s in w.sessions)


def test_synthetic_per_tool_gaps_make_a_fixed_lease_wrong_for_some_tools(tmp_path):
    from bench.workloads.synthetic import TOOLS, SynthParams, generate

    w = generate(SynthParams(sessions=200, max_depth=40, tool_gaps=True, seed=3))
    gaps: dict[str, list[float]] = {}
    for s in w.sessions:
        assert s.calls[0].tool is None
        for c in s.calls[1:]:
            assert c.tool in {t.name for t in TOOLS}
            gaps.setdefault(c.tool, []).append(c.gap_s)
    med = {k: statistics.median(v) for k, v in gaps.items()}
    tau = 1.0  # the fixed lease today
    assert max(med[t] for t in ("grep", "find", "cat", "ls")) < tau / 5  # a 1 s lease holds KV 5x too long
    assert min(med[t] for t in ("python", "pytest")) > 2 * tau  # and expires before the return
    assert set(w.meta["tool_gaps"]) == {t.name for t in TOOLS}
    from bench.workloads import describe

    d = describe(w)["gap_by_tool"]
    assert d["pytest"]["p50_s"] > 2 * tau > d["grep"]["p95_s"] and sum(v["n"] for v in d.values()) == w.num_calls - len(w.sessions)
    back = read_jsonl(write_jsonl(w, tmp_path / "w.jsonl"))
    assert [c.tool for s in back.sessions for c in s.calls] == [c.tool for s in w.sessions for c in s.calls]


def test_synthetic_two_model_sessions_alternate_agent_and_user_simulator():
    from bench.workloads.synthetic import HANDOFF_S, SynthParams, generate

    w = generate(SynthParams(sessions=30, max_depth=30, two_model=True, seed=1))
    switches = 0
    for s in w.sessions:
        models = [c.model for c in s.calls]
        assert len(set(models)) <= 2 and models[0] == s.model  # the agent opens
        prompts = resolve_prompts(s)
        for i in range(1, len(s.calls)):
            prev, cur, c = models[i - 1], models[i], s.calls[i]
            if cur != prev:
                switches += 1
                assert c.gap_s < HANDOFF_S.p95 * 20  # a hand-off, not a tool run
            if c.prefix_tokens >= len(prompts[i - 1]):
                assert prompts[i][: len(prompts[i - 1])] == prompts[i - 1]  # one transcript grows
            # the user simulator never speaks twice in a row
            assert not (prev == cur != s.model)
    assert switches > len(w.sessions)  # they really alternate
    from bench.workloads import describe

    assert describe(w)["models_per_session_max"] == 2
    with pytest.raises(ValueError):
        SynthParams(models=("only",), two_model=True)


def test_workload_cli_flags():
    from bench.cli import add_cli
    from bench.replay import load_workload

    p = argparse.ArgumentParser()
    add_cli(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["bench", "matrix", "--two-model", "--tool-gaps", "--sessions", "3", "--max-depth", "4"])
    w = load_workload(a)
    assert w.meta.get("two_model") and w.meta.get("tool_gaps") and len(w.sessions) == 3
    with pytest.raises(SystemExit):  # one trace source at a time
        p.parse_args(["bench", "matrix", "--miniswe", "a", "--mooncake", "b"])


# ---------------------------------------------------------------------------------- baselines
def test_matrix_has_the_papers_baselines():
    from bench.matrix import CONFIGS, OFF, availability

    by = {c.name: c for c in CONFIGS}
    ro, lp = by["Round-only"], by["Round-only+LP"]
    assert ro.kind == lp.kind == "baseline" and ro.overrides == OFF
    assert lp.overrides == {**OFF, "router.placement.policy": "least-pressure"}
    assert availability(lp) is None
    assert [c.name for c in CONFIGS if c.kind == "baseline"] == ["Round-only", "Round-only+LP"]
    from talaria.config import EngineConfig

    # the SP gain check's ablation runs as soon as the engine config has the knob (policy default: on)
    expect = None if "sp_gain_check" in EngineConfig.model_fields else "knob engines[].sp_gain_check missing"
    assert availability(by["SP-ungated"]) == expect


def _summary(scts: dict[str, float], load: float = 0.5) -> dict:
    vals = sorted(scts.values())
    from bench.workloads import nearest_rank

    return {"sct_p50_s": nearest_rank(vals, 50), "sct_p95_s": nearest_rank(vals, 95), "ttft_p50_s": 1.0, "ttft_p95_s": 2.0,
            "calls_failed": 0, "scts": dict(scts), "ttfts": [1.0], "loadavg_before": [load, 0, 0], "loadavg_after": [load + 0.1, 0, 0]}


def test_ratios_vs_the_best_baseline_per_metric():
    from bench.report import add_ratios, matrix_table

    sessions = [f"s{i}" for i in range(10)]
    talaria = {s: 10.0 + i for i, s in enumerate(sessions)}
    ro = {s: 20.0 + i for i, s in enumerate(sessions)}
    lp = {s: 12.0 + (30 if i == 9 else i) for i, s in enumerate(sessions)}  # better p50, worse p95 than RO
    rows = [{"name": "Talaria", "kind": "ablation", "summary": _summary(talaria)},
            {"name": "Round-only", "kind": "baseline", "summary": _summary(ro)},
            {"name": "Round-only+LP", "kind": "baseline", "summary": _summary(lp)}]
    add_ratios(rows)
    t = rows[0]["summary"]
    assert t["best_baseline_sct_p50"] == "Round-only+LP" and t["best_baseline_sct_p95"] == "Round-only"
    assert t["sct_p50_vs_best"] == pytest.approx(14 / 16) and t["sct_p95_vs_best"] == pytest.approx(19 / 29)
    lo, hi = t["sct_p50_vs_best_ci"]
    assert lo <= t["sct_p50_vs_best"] <= hi < 1.0
    assert t["sessions_won_lost_tied_vs_base"] == [10, 0, 0]
    table = matrix_table(rows)
    assert "0.88 (" in table and "0.50->0.60" in table


# --------------------------------------------------------------------------------- statistics
def test_bootstrap_ratio_ci_is_seeded_pure_and_exact_on_exact_ratios():
    from bench.stats import bootstrap_ratio_ci, point_ratio

    base = {f"s{i}": 10.0 + 3 * i for i in range(12)}
    same = dict(base)
    double = {k: 2 * v for k, v in base.items()}
    assert bootstrap_ratio_ci([(same, [base])], 50) == (1.0, 1.0)  # identical: every resample gives 1
    assert bootstrap_ratio_ci([(double, [base])] * 3, 95) == (2.0, 2.0)
    noisy = {k: v * (1.3 if i % 2 else 0.8) for i, (k, v) in enumerate(base.items())}
    a = bootstrap_ratio_ci([(noisy, [base])], 50, seed=7)
    assert a == bootstrap_ratio_ci([(noisy, [base])], 50, seed=7)  # same seed, same interval
    assert a[0] < point_ratio([(noisy, [base])], 50) <= a[1] and a[0] < a[1]
    # pairing: a session the numerator did not complete is left out on both sides
    partial = {k: v for k, v in double.items() if k != "s11"}
    assert bootstrap_ratio_ci([(partial, [base])], 50) == (2.0, 2.0)
    # the best of several denominators, per resample
    quad = {k: 4 * v for k, v in base.items()}
    assert bootstrap_ratio_ci([(double, [quad, double])], 50) == (1.0, 1.0)  # the smaller denominator wins
    assert all(math.isnan(x) for x in bootstrap_ratio_ci([({"a": 1.0}, [{"b": 1.0}])], 50))
    with pytest.raises(ValueError):
        bootstrap_ratio_ci([(base, [base])], 50, level=1.0)


def test_bootstrap_interval_widens_with_run_to_run_drift():
    from bench.stats import bootstrap_ratio_ci

    base = {f"s{i}": 10.0 + i for i in range(10)}
    steady = [({k: 0.8 * v for k, v in base.items()}, [base])] * 5
    drifting = [({k: f * v for k, v in base.items()}, [base]) for f in (0.5, 0.7, 0.8, 1.0, 1.3)]
    s_lo, s_hi = bootstrap_ratio_ci(steady, 50)
    d_lo, d_hi = bootstrap_ratio_ci(drifting, 50)
    assert s_hi - s_lo < 1e-9 and d_hi - d_lo > 0.2 and d_lo < 0.8 < d_hi


def test_wins_losses_and_paired_wins():
    from bench.stats import loadavg, paired_wins, wins_losses

    assert wins_losses([0.8, 1.2, 0.9, float("nan"), 1.0]) == (2, 1)
    assert paired_wins({"a": 1.0, "b": 3.0, "c": 2.0, "x": 9.0}, {"a": 2.0, "b": 2.0, "c": 2.0}) == (1, 1, 1)
    lp = loadavg()
    assert lp is None or (len(lp) == 3 and all(x >= 0 for x in lp))
    assert loadavg("/nonexistent/loadavg") is None


def test_aggregate_repeats_reports_best_baseline_ci_wins_and_load(tmp_path):
    from bench.report import combine_repeats, repeats_table, repetitions_table, write_matrix_report

    sessions = [f"s{i}" for i in range(8)]
    reps = []
    for r, f in enumerate((0.6, 0.7, 1.1, 0.8, 0.75)):  # Talaria / Round-only per repetition
        ro = {s: (10.0 + i) * (1 + 0.2 * r) for i, s in enumerate(sessions)}
        lp = {s: v * 1.05 for s, v in ro.items()}
        ta = {s: v * f for s, v in ro.items()}
        reps.append([{"name": "Talaria", "kind": "ablation", "status": "ok", "summary": _summary(ta, 0.3 + r)},
                     {"name": "Round-only", "kind": "baseline", "status": "ok", "summary": _summary(ro)},
                     {"name": "Round-only+LP", "kind": "baseline", "status": "ok", "summary": _summary(lp)}])
    rows, agg = combine_repeats(reps)
    t = {a["name"]: a for a in agg}["Talaria"]
    assert t["ratios"]["sct_p50_vs_best"]["median"] == pytest.approx(0.75)
    assert t["wins_losses"]["sct_p50_vs_best"] == [4, 1]
    lo, hi = t["ci95"]["sct_p50_vs_best"]
    assert lo <= 0.75 <= hi and lo >= 0.6 - 1e-9 and hi <= 1.1 + 1e-9
    assert t["load1"]["min"] == pytest.approx(0.3) and t["load1"]["max"] == pytest.approx(4.4)
    assert rows[0]["summary"]["sct_p50_vs_best_ci"] == [lo, hi]
    table = repeats_table(agg)
    assert "4/1" in table and "0.30-4.40" in table and "CI95" in table
    from bench.report import repetition_rows

    assert "8/0/0" in repetitions_table(repetition_rows(reps))
    md = write_matrix_report(tmp_path, rows, {"command": "x", "workload_desc": "y", "loadavg_start": [0.1, 0.2, 0.3]}, repeats=reps).read_text()
    assert "Best baseline" in md and "[0.1, 0.2, 0.3]" in md
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["rows"][0]["aggregate"]["wins_losses"]["sct_p50_vs_best"] == [4, 1]


def test_each_ablation_is_judged_against_talaria_with_a_paired_interval(tmp_path):
    """Issue 12's done-when: "turning a mechanism off never helps by more than the confidence interval". The
    report pairs every non-baseline row with Talaria per repetition and says per quantile whether the
    interval is below 1 (off helps), above 1 (the mechanism pays) or holds 1 (tie)."""
    from bench.report import ablation_verdict, ablations_table, combine_repeats, write_matrix_report

    sessions = [f"s{i}" for i in range(12)]
    reps = []
    for r in range(5):
        ro = {s: (10.0 + i) * (1 + 0.1 * r) for i, s in enumerate(sessions)}
        ta = {s: v * 0.8 for s, v in ro.items()}
        rows = [{"name": "Talaria", "kind": "ablation", "status": "ok", "summary": _summary(ta)},
                {"name": "Round-only", "kind": "baseline", "status": "ok", "summary": _summary(ro)}]
        rows.append({"name": "no-A", "kind": "ablation", "status": "ok", "summary": _summary({s: v * 1.2 for s, v in ta.items()})})  # A pays
        rows.append({"name": "no-B", "kind": "ablation", "status": "ok", "summary": _summary({s: v * 0.9 for s, v in ta.items()})})  # B costs
        # C: off is as often faster as slower, session by session and repetition by repetition
        rows.append({"name": "no-C", "kind": "ablation", "status": "ok",
                     "summary": _summary({s: v * (1.08 if (i + r) % 2 else 0.93) for i, (s, v) in enumerate(ta.items())})})
        reps.append(rows)
    out, agg = combine_repeats(reps)
    by = {a["name"]: a for a in agg}
    assert "sct_p50_vs_talaria" not in by["Talaria"]["ci95"]  # never against itself
    verdict = {n: ablation_verdict(by[n]["ci95"]["sct_p50_vs_talaria"]) for n in ("no-A", "no-B", "no-C")}
    assert verdict == {"no-A": "pays", "no-B": "off helps", "no-C": "tie"}
    assert by["no-B"]["wins_losses"]["sct_p50_vs_talaria"] == [5, 0]
    lo, hi = by["no-A"]["ci95"]["sct_p95_vs_talaria"]
    assert lo == pytest.approx(1.2) and hi == pytest.approx(1.2)  # exact ratios: a zero-width interval
    table = ablations_table(agg, ["Round-only"])
    assert "Round-only" not in table and table.count("off helps") == 2 and "no-C" in table
    assert ablation_verdict([math.nan, 1.1]) == "n/a"
    assert ablations_table([a for a in agg if a["name"] != "Talaria"], ["Round-only"]) == ""  # no reference, no table
    md = write_matrix_report(tmp_path, out, {"command": "x", "workload_desc": "y"}, repeats=reps).read_text()
    assert "Each configuration against Talaria" in md and "off helps" in md


def test_lease_rows_are_read_against_the_best_fixed_tau_paired_per_repetition(tmp_path):
    """Issue 14 on the stack: `bench matrix --configs lease-...` reports the adaptive row against the best fixed tau
    the way `sim leases` does (geometric means, paired per repetition, KV held by leases), and says whether the
    goal is met; a repetition where a lease row failed is left out of the pairing."""
    from bench.report import combine_repeats, lease_comparison, lease_table, write_matrix_report

    sessions = [f"s{i}" for i in range(10)]
    reps = []
    for r, drift in enumerate((1.0, 1.3, 0.8, 1.1)):  # machine drift per repetition, shared by every row
        base = {s: (10.0 + i) * drift for i, s in enumerate(sessions)}

        def row(name, f95, factor, token_s):
            scts = {s: v * (f95 if i == len(sessions) - 1 else factor) for i, (s, v) in enumerate(base.items())}
            return {"name": name, "kind": "lease", "status": "ok",
                    "summary": _summary(scts) | {"lease_hits": 10.0, "leases_unused": 5.0, "lease_expiries": 1.0, "leases_declined": 0.0,
                                                 "lease_outweighed": 0.0, "lease_token_s": token_s}}
        rows = [row("lease-fixed-1", 1.0, 1.0, 100.0), row("lease-fixed-5", 0.9, 0.95, 400.0),
                row("lease-adaptive", (0.89, 0.93, 0.91, 0.9)[r], 0.96 if r % 2 else 0.93, 300.0), row("no-leases", 1.1, 1.05, 0.0)]
        if r == 3:
            rows[2] = {"name": "lease-adaptive", "kind": "lease", "status": "failed: engine died"}
        reps.append(rows)
    c = lease_comparison(reps)
    assert c["repetitions"] == 3  # the fourth lost its adaptive run
    a = c["vs_best_fixed"]["lease-adaptive"]
    assert (a["best_fixed_p50"], a["best_fixed_p95"]) == ("lease-fixed-5", "lease-fixed-5")
    p50 = a["paired_sct_p50_vs_best"]
    assert p50["ratio"] == pytest.approx((0.93 * 0.96 * 0.93) ** (1 / 3) / 0.95) and p50["n"] == 3 and p50["wins"] == 2
    assert a["paired_sct_p95_vs_best"]["ratio"] == pytest.approx((0.89 * 0.93 * 0.91) ** (1 / 3) / 0.9)
    assert a["kv_vs_best"] == pytest.approx(0.75) and a["goal_met"] is True and a["beats"] is False  # both intervals hold 1; p95 ratio > 1
    assert c["rows"]["lease-fixed-1"]["sct_p50_s"] == pytest.approx(14.0 * (1.0 * 1.3 * 0.8) ** (1 / 3))  # geometric mean over repetitions
    assert c["vs_best_fixed"]["no-leases"]["paired_sct_p95_vs_best"]["ratio"] == pytest.approx(1.1 / 0.9)
    text = lease_table(c)
    assert "lease-adaptive: SCT p50" in text and "goal met" in text and "no-leases: SCT p50" in text
    assert lease_comparison([[r for r in rep if r["name"] != "lease-adaptive" and r["name"] != "no-leases"] for rep in reps]) == {}
    rows_, _ = combine_repeats(reps)
    md = write_matrix_report(tmp_path, rows_, {"command": "x", "workload_desc": "y"}, repeats=reps).read_text()
    assert "Lease policies against the best fixed tau" in md
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["lease_comparison"]["repetitions"] == 3
    assert [r["lease_token_s"] for r in data["repetitions"][:4]] == [100.0, 400.0, 300.0, 0.0]  # per repetition, for re-reading


def test_the_public_mooncake_trace_goes_through_the_existing_importer(mooncake_trace):
    from bench.workloads import describe
    from bench.workloads.mooncake import MooncakeParams, derive_sessions, import_mooncake

    records = [json.loads(x) for x in mooncake_trace.read_text().splitlines() if x.strip()]
    groups = derive_sessions(records)
    assert (len(groups), sum(len(g) >= 2 for g in groups)) == (2725, 348)  # as bench/workloads/README.md states
    w = import_mooncake(MooncakeParams(sessions=10))  # no path: the resolver's default
    d = describe(w)
    assert d["sessions"] == 10 and d["prompt_max"] <= 3584 and d["reuse_over_half_share"] > 0.5


# ------------------------------------------------------------------------ latency attribution
def test_latency_split_reads_recorded_components_and_never_estimates(tmp_path):
    from bench.report import LATENCY_COMPONENTS, latency_split, latency_table, write_matrix_report

    recs = [
        {"kind": "call", "phase": "start", "arrival_unix": 100.0},
        {"kind": "call", "phase": "end", "arrival_unix": 100.0, "end_unix": 102.0, "round_wait_s": 0.5,
         "attribution": {"decode_seconds": 1.0}},
        {"kind": "call", "phase": "end", "arrival_unix": 200.0, "end_unix": 201.0, "round_wait_s": 0.1, "decode_s": 0.5},
        {"kind": "call", "phase": "end", "arrival_unix": 300.0, "end_unix": 309.0, "error": "timeout", "decode_s": 9.0},
    ]
    ls = latency_split(recs)
    assert ls["calls"] == 2 and ls["total_s"] == pytest.approx(1.5)
    assert ls["components"]["round wait"] == pytest.approx(0.3) and ls["components"]["decode"] == pytest.approx(0.75)
    assert all(ls["components"][n] is None for n, _k in LATENCY_COMPONENTS if n not in ("round wait", "decode"))
    assert ls["unattributed_s"] == pytest.approx(1.5 - 1.05)
    assert latency_split(None)["components"]["decode"] is None
    rows = [{"name": "Talaria", "summary": {"latency_split": ls, "sct_p50_s": 1.0, "sct_p95_s": 1.0, "ttft_p50_s": 1.0,
                                            "ttft_p95_s": 1.0, "scts": {"s": 1.0}, "ttfts": [1.0]}}]
    table = latency_table(rows)
    assert "not recorded" in table and "0.300" in table and "0.450" in table
    md = write_matrix_report(tmp_path, rows, {"command": "x", "workload_desc": "y"}).read_text()
    assert "Where a call's time goes" in md
    assert ls["by_placement"]["?/?/?/resident"]["calls"] == 2  # no start records here: one unknown group
    recs[0].update(request_id="a", placement_reason="lease", lease="hit", kv_source="device")
    recs[1]["request_id"] = "a"
    assert latency_split(recs)["by_placement"]["lease/hit/device/resident"]["components"]["decode"] == pytest.approx(1.0)
    assert "Time split by placement" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "latency_split.png").exists()
