"""``talaria bench sp``: session-prefill (SP) admission on a real cold engine — Talaria vs no-SP vs Round-only.

What is measured
    One slot-scheduled ``ColdEngine`` per configuration (services/engine/cold/slotted.py: the round/slot
    scheduler of Talaria §3.4 driving the real multi-model cold engine of services/engine/cold/engine.py) over
    three synthesized models (default tiny-llama, tiny-qwen2, tiny-qwen3) on the CPU, float32, in this one
    process. The same fixed replay (Talaria §5.1) runs on each: ``sessions`` agent sessions spread over the
    three models, each ``depth`` calls long; a call's prompt is the previous prompt + the previous answer +
    a few new tokens (a tool result); the next call of a session arrives a recorded tool gap after the
    previous one finished (closed loop); greedy decoding with fixed output lengths. Configurations:

    * ``talaria``   — SP on, host KV on, D2D staging on;
    * ``no-sp``     — SP off (returns wait for the next slot of their model), the rest the same;
    * ``round-only``— SP, host KV and D2D staging all off (the paper's Round-only baseline).

    Host KV needs a running kvstore (issue 4); this benchmark does not start one, so in every configuration
    a session's KV does not survive a switch of its model (it is recomputed at the next P) — the host_kv
    switch changes nothing here, and the comparison isolates SP and D2D staging.

    Reported per configuration: TTFT p50/p95 of *returning* calls (calls after a session's first; from the
    intended arrival time, schedule-aware), SCT p50/p95 (first arrival to last response), SP events admitted
    and deferred (one event per call per slot), rounds, deadline-risk rounds, mean round wall and switch
    share. Configurations run in alternating order over ``repeats`` repetitions; the table shows medians
    and the ratios to Talaria measured in the same run. Outputs of all configurations are checked equal
    (they are greedy and schedule-independent).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import ensure_models, format_table, median, percentile

MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")


@dataclass
class _Session:
    sid: str
    model: str
    start: float
    first: list[int]
    extras: list[list[int]]
    out_tokens: list[int]
    gaps: list[float]


def make_replay(seed: int, sessions: int, depth: int, models=MODELS) -> list[_Session]:
    rng = random.Random(seed)
    out = []
    for i in range(sessions):
        first = [rng.randrange(3, 500) for _ in range(rng.randint(48, 160))]
        extras = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 32))] for _ in range(depth - 1)]
        outs = [rng.randint(4, 40) for _ in range(depth)]
        gaps = [rng.uniform(0.02, 0.3) for _ in range(depth)]
        out.append(_Session(f"s{i}", models[i % len(models)], rng.uniform(0.0, 0.3), first, extras, outs, gaps))
    return out


@dataclass
class _Run:
    ttft_returning: list[float] = field(default_factory=list)
    ttft_first: list[float] = field(default_factory=list)
    sct: list[float] = field(default_factory=list)
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    summaries: list[Any] = field(default_factory=list)
    wall: float = 0.0


def replay(ce, sessions: list[_Session]) -> _Run:
    from services.engine.types import EngineRequest, SamplingParams

    t0 = time.monotonic()
    st = {s.sid: {"k": 0, "prompt": list(s.first), "due": t0 + s.start, "outs": []} for s in sessions}
    live: dict[str, tuple[_Session, float, list[int], list[float]]] = {}
    first_arrival: dict[str, float] = {}
    res = _Run()
    remaining = sum(len(s.out_tokens) for s in sessions)
    while remaining:
        now = time.monotonic()
        for s in sessions:
            x = st[s.sid]
            if x["due"] is not None and x["due"] <= now:
                k = x["k"]
                rid = f"{s.sid}#{k}"
                sp = SamplingParams(temperature=0.0, max_tokens=s.out_tokens[k], ignore_eos=True)
                ce.add_request(EngineRequest(rid, list(x["prompt"]), sp, session_id=s.sid, arrival_time=x["due"], model=s.model))
                live[rid] = (s, x["due"], [], [])
                first_arrival.setdefault(s.sid, x["due"])
                x["due"] = None
        if not ce.has_unfinished():
            nxt = min((x["due"] for x in st.values() if x["due"] is not None), default=None)
            if nxt is not None:
                time.sleep(max(0.0, nxt - time.monotonic()))
            continue
        for o in ce.step():
            s, arrival, toks, first = live[o.request_id]
            if o.new_token_ids and not first:
                first.append(time.monotonic())
                (res.ttft_returning if not o.request_id.endswith("#0") else res.ttft_first).append(first[0] - arrival)
            toks += o.new_token_ids
            if o.finished:
                remaining -= 1
                x = st[s.sid]
                x["outs"].append(list(toks))
                k = x["k"]
                if k < len(s.extras):
                    x["prompt"] = x["prompt"] + toks + s.extras[k]
                x["k"] = k + 1
                if x["k"] < len(s.out_tokens):
                    x["due"] = time.monotonic() + s.gaps[k]
                else:
                    res.sct.append(time.monotonic() - first_arrival[s.sid])
    res.wall = time.monotonic() - t0
    ce.step()  # closes the last round (no work left)
    res.summaries = ce.take_round_summaries()
    res.outputs = {sid: x["outs"] for sid, x in st.items()}
    return res


CONFIGS = ("talaria", "no-sp", "round-only")


def _policy(name: str, ttft_s: float, tpot_s: float, gamma: float):
    from services.engine.slots import SlotPolicy

    kw = dict(ttft_s=ttft_s, tpot_s=tpot_s, gamma=gamma)
    if name == "talaria":
        return SlotPolicy(**kw)
    if name == "no-sp":
        return SlotPolicy(sp=False, **kw)
    return SlotPolicy.round_only(**kw)


def run_sp_bench(*, models_dir=None, sessions: int = 9, depth: int = 5, repeats: int = 1, seed: int = 0,
                 ttft_s: float = 1.0, tpot_s: float = 0.05, gamma: float = 0.8, threads: int | None = 1, say=print) -> dict:
    import torch

    from services.engine.cold.engine import ColdEngine
    from services.engine.cold.slotted import SlotSwitching

    if threads:
        torch.set_num_threads(threads)
    root = ensure_models(models_dir, list(MODELS), say=say)
    catalog = {m: root / m for m in MODELS}
    engines = {}
    for name in CONFIGS:
        pol = _policy(name, ttft_s, tpot_s, gamma)
        engines[name] = ColdEngine(catalog, switching=SlotSwitching(pol), page_size=16, kv_cache_bytes=32 << 20, chunk_bytes=256 * 1024,
                                          runtime_bytes=64 * 1024, staging=pol.d2d_staging)
    replay_spec = make_replay(seed, sessions, depth)
    # warm-up: one short call per model on every engine (first forward allocations)
    from services.engine.types import SamplingParams

    for ce in engines.values():
        for m in MODELS:
            ce.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), model=m)
        ce.take_round_summaries()
    runs: dict[str, list[_Run]] = {n: [] for n in CONFIGS}
    for r in range(repeats):
        order = CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS))
        for name in order:
            say(f"repetition {r + 1}/{repeats}: {name} ...")
            runs[name].append(replay(engines[name], replay_spec))
    ref = runs["talaria"][0].outputs
    same = all(run.outputs == ref for rs in runs.values() for run in rs)
    rows = {}
    for name, rs in runs.items():
        sums = [s for run in rs for s in run.summaries]
        walls = [s.wall_s for s in sums]
        rows[name] = {
            "ttft_ret_p50": median([percentile(r.ttft_returning, 50) for r in rs]),
            "ttft_ret_p95": median([percentile(r.ttft_returning, 95) for r in rs]),
            "sct_p50": median([percentile(r.sct, 50) for r in rs]),
            "sct_p95": median([percentile(r.sct, 95) for r in rs]),
            "ttft_first_p50": median([percentile(r.ttft_first, 50) for r in rs]),
            "sp_admitted": sum(s.sp_admitted for s in sums) / len(rs),
            "sp_deferred": sum(s.sp_deferred for s in sums) / len(rs),
            "rounds": len(sums) / len(rs),
            "risk_rounds": sum(s.deadline_risk for s in sums) / len(rs),
            "round_wall_mean": sum(walls) / len(walls) if walls else float("nan"),
            "switch_share": (sum(s.switch_s for s in sums) / sum(walls)) if walls and sum(walls) else float("nan"),
            "switch_paths": _count(p for s in sums for p in s.switch_paths),
            "sp_ineligible": _merge(s.sp_ineligible for s in sums),
            "replay_wall_s": median([r.wall for r in rs]),
        }
    return {
        "models": list(MODELS), "sessions": sessions, "depth": depth, "repeats": repeats, "seed": seed,
        "policy": {"ttft_s": ttft_s, "tpot_s": tpot_s, "gamma": gamma}, "threads": threads,
        "outputs_identical": same, "configs": rows,
        "calls": sum(len(s.out_tokens) for s in replay_spec), "returning_calls": sum(len(s.out_tokens) - 1 for s in replay_spec),
    }


def _count(it) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in it:
        out[x] = out.get(x, 0) + 1
    return out


def _merge(dicts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def render(res: dict) -> str:
    rows = res["configs"]
    base = rows["talaria"]
    head = ["config", "TTFT ret p50 s", "TTFT ret p95 s", "SCT p50 s", "SCT p95 s", "TTFT p50 /talaria", "SCT p50 /talaria",
            "SP admitted", "SP deferred", "rounds", "risk rounds", "switch share"]
    table = []
    for name in CONFIGS:
        r = rows[name]
        table.append([name, r["ttft_ret_p50"], r["ttft_ret_p95"], r["sct_p50"], r["sct_p95"],
                      r["ttft_ret_p50"] / base["ttft_ret_p50"] if base["ttft_ret_p50"] else float("nan"),
                      r["sct_p50"] / base["sct_p50"] if base["sct_p50"] else float("nan"),
                      r["sp_admitted"], r["sp_deferred"], r["rounds"], r["risk_rounds"], r["switch_share"]])
    p = res["policy"]
    lines = [
        f"real cold engine, models {', '.join(res['models'])}; {res['sessions']} sessions x {res['depth']} calls "
        f"({res['returning_calls']} returning); T_TTFT={p['ttft_s']} s, T_TPOT={p['tpot_s']} s, gamma={p['gamma']}; "
        f"repeats={res['repeats']}; outputs identical across configs: {res['outputs_identical']}",
        format_table(head, table),
        "switch paths: " + "; ".join(f"{n}: {rows[n]['switch_paths']}" for n in CONFIGS),
        "SP ineligible (unique per slot): " + "; ".join(f"{n}: {rows[n]['sp_ineligible']}" for n in CONFIGS),
    ]
    return "\n".join(lines)


def main(args) -> int:
    res = run_sp_bench(models_dir=args.models_dir, sessions=args.sessions, depth=args.depth, repeats=args.repeats,
                       seed=args.seed, ttft_s=args.ttft, tpot_s=args.tpot, gamma=args.gamma, threads=args.threads)
    print()
    print(render(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if res["outputs_identical"] else 1
