"""``talaria bench coldpool``: JointServe's streaming hot-swap and Aegaeon's per-token deadlines on the real
cold engine (issue 16), each against Talaria's own mechanism, measured side by side in one run.

What is measured (one process, CPU, float32, synthesized models; default tiny-llama, tiny-qwen2, tiny-qwen3)

A. **TTFT of a cold model's first call**: two ``ColdEngine``s over the same catalog with D2D staging off (so
   the called model is nowhere on the device: a host-only switch), both copying through the same transfer
   scheduler: ``load-all`` (k* forced to every group: phase 2 copies every chunk, then prefill) and
   ``streaming`` (``partial_layers``: phase 2 copies the startup prefix k* chosen from the measured copy and
   compute times, later layer groups stream while the prefill runs; each group waits for its own copy).
   ``--channel-mbps`` throttles that channel to emulate a link slower than host memcpy (an emulation, said
   so in the output). For every repetition and every model, another model is
   made active first, then one call of ``--prompt`` tokens is sent; TTFT = first token − submission (wall,
   includes the switch). Outputs of both engines are checked identical.
B. **SLO attainment, token deadlines vs rounds**: two slot-scheduled ``ColdEngine``s, the round/slot scheduler
   (Talaria §3.4) and the token-deadline scheduler (``token_deadlines``), replay the same closed-loop agent
   sessions (``bench/sp_bench.make_replay``). Every token of every call is scored against its deadline in both
   modes (first token: arrival + T_TTFT; token i: first-token time + (i−1)·T_TPOT): attainment, TTFT
   attainment, inter-token gap p50/p99/max, SCT p50 and switches.

Numbers are from a shared, loaded machine: the load average is recorded beside them; ratios within one run
are what to read, not absolute times.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench import ensure_models, format_table, median, percentile
from bench.stats import loadavg

MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")


def _engine(catalog, stream: bool, channel_mbps: float | None):
    """A cold engine whose every weight copy goes through one transfer scheduler; ``stream`` False forces
    k* = all groups (load-all-then-run through the same channel), so the two configs differ only in k*.
    ``channel_mbps`` throttles the channel to emulate a slower host->device link (emulation, not a device)."""
    from services.engine.cold.engine import ColdEngine
    from services.engine.streaming_swap import stream_copy
    from services.engine.substrate.groups import layer_groups
    from services.engine.substrate.transfer import TransferScheduler

    def copy(p):
        t0 = time.perf_counter()
        stream_copy(p)
        if channel_mbps:
            nbytes = p[0].numel() * p[0].element_size()
            time.sleep(max(0.0, nbytes / (channel_mbps * 1e6) - (time.perf_counter() - t0)))

    ce = ColdEngine(catalog, page_size=16, kv_cache_bytes=32 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024,
                    staging=False, partial_layers=True, transfer=TransferScheduler(copy_fn=copy))
    if not stream:
        ce.streamer.plan_k = lambda m: len(layer_groups(ce.bank[m]))
    return ce


def _first_call_ttft(ce, model: str, other: str, prompt: list[int]) -> tuple[float, list[int], dict]:
    from services.engine.types import EngineRequest, SamplingParams

    if ce.active != other:
        ce.switch_to(other, "bench")
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rid = f"cold-{model}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    ce.add_request(EngineRequest(rid, list(prompt), sp, arrival_time=time.monotonic(), model=model))
    ttft, toks = None, []
    while ce.has_unfinished():
        for o in ce.step():
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            toks += o.new_token_ids
    rec = ce.switch_records[-1]
    return ttft, toks, {"switch_s": rec.total_seconds, "h2d_s": rec.h2d_seconds}


def run_ttft(catalog, prompt_len: int, repeats: int, channel_mbps: float | None = None, say=print) -> dict:
    import random

    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(prompt_len)]
    engines = {"load-all": _engine(catalog, False, channel_mbps), "streaming": _engine(catalog, True, channel_mbps)}
    names = list(catalog)
    for ce in engines.values():  # warm-up: every model once (first-forward allocations, measured prefill cost)
        for m in names:
            _first_call_ttft(ce, m, names[(names.index(m) + 1) % len(names)], prompt[:32])
            _first_call_ttft(ce, m, names[(names.index(m) + 1) % len(names)], prompt)
    rows: dict[str, dict[str, list[float]]] = {n: {"ttft": [], "switch": []} for n in engines}
    outs: dict[str, dict[str, list[int]]] = {n: {} for n in engines}
    for r in range(repeats):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for m in names:
            other = names[(names.index(m) + 1) % len(names)]
            for n in order:
                ttft, toks, rec = _first_call_ttft(engines[n], m, other, prompt)
                rows[n]["ttft"].append(ttft)
                rows[n]["switch"].append(rec["switch_s"])
                outs[n][m] = toks
        say(f"TTFT repetition {r + 1}/{repeats} done")
    st = (engines["streaming"].streamer.snapshot() if engines["streaming"].streamer is not None else {})
    for ce in engines.values():
        if ce.streamer is not None:
            ce.streamer.transfer.close()
    return {
        "prompt_tokens": prompt_len, "repeats": repeats, "channel_mbps": channel_mbps, "outputs_identical": outs["load-all"] == outs["streaming"],
        "configs": {n: {"ttft_p50": median(v["ttft"]), "ttft_p95": percentile(v["ttft"], 95), "switch_p50": median(v["switch"]),
                        "samples": len(v["ttft"])} for n, v in rows.items()},
        "streaming": {"k": st.get("k"), "stall_s": st.get("stall_s"), "streams": st.get("streams"),
                      "channel_bytes_per_s": st.get("channel_bytes_per_s")},
    }


def run_slo(catalog, sessions: int, depth: int, ttft_s: float, tpot_s: float, seed: int, say=print) -> dict:
    from bench.sp_bench import make_replay, replay
    from services.engine.slots import SlotPolicy
    from services.engine.cold.engine import ColdEngine
    from services.engine.cold.slotted import SlotSwitching
    from services.engine.types import SamplingParams

    spec = make_replay(seed, sessions, depth, tuple(catalog))
    res = {}
    for name, td in (("rounds", False), ("token-deadlines", True)):
        pol = SlotPolicy(ttft_s=ttft_s, tpot_s=tpot_s, token_deadlines=td)
        ce = ColdEngine(catalog, switching=SlotSwitching(pol), page_size=16, kv_cache_bytes=32 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024)
        for m in catalog:
            ce.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), model=m)
        ce.take_round_summaries()
        ce.switching.deadlines.reset_totals()
        n0 = ce.protocol.seq
        say(f"SLO replay: {name} ...")
        run = replay(ce, spec)
        t = ce.switching.deadlines.totals()
        res[name] = {
            "attainment": t.attainment, "ttft_attainment": t.ttft_attainment, "tokens": t.tokens + t.first_tokens,
            "gap_p50": t.gap_p50_s, "gap_p99": t.gap_p99_s, "gap_max": t.gap_max_s, "sct_p50": median(run.sct),
            "ttft_p50": median(run.ttft_first + run.ttft_returning), "switches": ce.protocol.seq - n0,
            "outputs": run.outputs, "gap_counts": list(t.gap_counts),
        }
    same = res["rounds"]["outputs"] == res["token-deadlines"]["outputs"]
    for r in res.values():
        del r["outputs"]
    return {"sessions": sessions, "depth": depth, "ttft_s": ttft_s, "tpot_s": tpot_s, "outputs_identical": same, "configs": res}


def run(models_dir=None, *, prompt: int = 384, repeats: int = 3, sessions: int = 6, depth: int = 3, ttft_s: float = 1.0,
        tpot_s: float = 0.05, seed: int = 0, threads: int | None = 1, skip_slo: bool = False, channel_mbps: float | None = None,
        say=print) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    root = ensure_models(models_dir, list(MODELS), say=say)
    catalog = {m: root / m for m in MODELS}
    load0 = loadavg()
    out = {"models": list(MODELS), "threads": threads, "loadavg_before": load0}
    out["ttft"] = run_ttft(catalog, prompt, repeats, channel_mbps, say)
    out["loadavg_mid"] = loadavg()
    if not skip_slo:
        out["slo"] = run_slo(catalog, sessions, depth, ttft_s, tpot_s, seed, say)
    out["loadavg_after"] = loadavg()
    return out


def render(res: dict) -> str:
    t = res["ttft"]
    rows = [[n, c["ttft_p50"], c["ttft_p95"], c["switch_p50"], c["samples"]] for n, c in t["configs"].items()]
    base = t["configs"]["load-all"]["ttft_p50"]
    lines = [
        f"A. cold model's first call, {t['prompt_tokens']}-token prompt, host-only switch (staging off), channel "
        f"{str(t.get('channel_mbps')) + ' MB/s (emulated)' if t.get('channel_mbps') else 'unthrottled memcpy'}; "
        f"outputs identical: {t['outputs_identical']}",
        format_table(["config", "TTFT p50 s", "TTFT p95 s", "switch p50 s", "samples"], rows),
        f"streaming / load-all TTFT p50: {t['configs']['streaming']['ttft_p50'] / base:.3f}; k*: {t['streaming']['k']}; "
        f"stall {t['streaming']['stall_s']} s over {t['streaming']['streams']} streams",
    ]
    if "slo" in res:
        s = res["slo"]
        rows = [[n, c["attainment"], c["ttft_attainment"], c["gap_p50"], c["gap_p99"], c["gap_max"], c["sct_p50"], c["switches"], c["tokens"]]
                for n, c in s["configs"].items()]
        lines += [
            f"B. {s['sessions']} sessions x {s['depth']} calls, T_TTFT={s['ttft_s']} s, T_TPOT={s['tpot_s']} s; outputs identical: {s['outputs_identical']}",
            format_table(["scheduler", "attainment", "TTFT attain.", "gap p50 s", "gap p99 s", "gap max s", "SCT p50 s", "switches", "tokens"], rows),
        ]
    lines.append(f"load average before/mid/after: {res['loadavg_before']} / {res['loadavg_mid']} / {res['loadavg_after']} (shared machine)")
    return "\n".join(lines)


def add_args(p) -> None:
    p.add_argument("--models-dir", help="checkpoints directory (default: .talaria/bench-models, synthesized if missing)")
    p.add_argument("--prompt", type=int, default=384, help="prompt tokens of the cold first call (default 384)")
    p.add_argument("--repeats", type=int, default=3, help="TTFT repetitions per model, configs alternating (default 3)")
    p.add_argument("--sessions", type=int, default=6, help="agent sessions of the SLO replay (default 6)")
    p.add_argument("--depth", type=int, default=3, help="calls per session (default 3)")
    p.add_argument("--ttft", type=float, default=1.0, help="T_TTFT target, seconds (default 1.0)")
    p.add_argument("--tpot", type=float, default=0.05, help="T_TPOT target, seconds (default 0.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--skip-slo", action="store_true", help="only part A")
    p.add_argument("--channel-mbps", type=float, help="part A: throttle the host->device channel to this many MB/s (emulates a link slower than memcpy)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")


def main(args) -> int:
    res = run(args.models_dir, prompt=args.prompt, repeats=args.repeats, sessions=args.sessions, depth=args.depth,
              ttft_s=args.ttft, tpot_s=args.tpot, seed=args.seed, threads=args.threads, skip_slo=args.skip_slo,
              channel_mbps=args.channel_mbps)
    print()
    print(render(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    ok = res["ttft"]["outputs_identical"] and res.get("slo", {}).get("outputs_identical", True)
    return 0 if ok else 1
