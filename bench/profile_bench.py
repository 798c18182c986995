"""``talaria bench profile``: measure a simulator profile (``talaria-profile/1``) from a real engine here.

What is measured (each number in the output says how, in its ``cite``):

* prefill: a fresh prompt of each length in ``--lengths`` (prefix cache flushed), time to the first
  token through ``Engine.step()`` with the engine's default chunked-prefill budget (as served), the
  repetitions outer and the lengths inner; the medians fitted as ``t = k * n**p``
  (``sim.profile.fit_power``), and each repetition fitted alone to give the fit's spread at 1,024 tokens
  (in the ``prefill_k`` cite);
* decode step: ``batch`` prompts of ``context`` tokens, the mean step time after every sequence has its
  first token (24 tokens each), over the grid ``--batches`` x ``--contexts`` (repetitions outer); least
  squares over the grid's medians ``base + per_seq*B + per_ctx*B*ctx``;
* restore per token: ``bench kvstore`` (real kvstore server, Mooncake on loopback, ``HostKV.restore_blocking``)
  on a ``--restore-tokens`` prefix, its restore step time / tokens; checkpoint per token: the CPU seconds the
  same prefix's checkpoint costs (a CPU engine's copies share its cores; the simulator charges them to steps);
* switch phases: a real ``ColdEngine`` over the models, ``full_staged`` (target staged first) and
  ``host_only`` switches; medians of the five recorded phases;
* sizes: weight bytes from the weight bank, KV bytes per token from the model config; HBM/host sizes of
  the ``bench matrix`` stack (two cold engines, ``kv_cache_mb`` 64, kvstore 1 GiB); knobs from
  ``EngineConfig`` defaults (the matrix's slot scheduler).

Medians over ``--repeats``; print ``/proc/loadavg`` beside the result: on this shared machine every
number moves with the load.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from bench import ensure_models

MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")  # the bench matrix's catalog
# The default workload's prompts run to 3,584 tokens (p50 ~800): six lengths across that range, so one
# slow measurement cannot swing the fitted exponent as it did with three (issue 15: two profiles measured
# 40 minutes apart put the recompute of 1,024 tokens at 142 vs 111 ms).
LENGTHS = (128, 256, 512, 1024, 2048, 3584)
PREFILL_PROBE_TOKENS = 1024  # where the profile reports its fit's spread over repetitions
# Decode: a grid of batch x context wide enough for the three-term fit (four points moved its per-sequence
# term by 40-64 % between two profiles measured a minute apart), each point DECODE_TOKENS steps long.
BATCHES = (1, 2, 4, 8)
CONTEXTS = (64, 512, 2048)
DECODE_TOKENS = 24


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ")[0]
    except OSError:
        return "n/a"


def _first_token_s(engine, prompt: list[int], rid: str) -> float:
    from services.engine.types import EngineRequest, SamplingParams

    engine.flush_cache()
    t0 = time.perf_counter()
    engine.add_request(EngineRequest(rid, list(prompt), SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)))
    while True:
        for o in engine.step():
            if o.new_token_ids:  # max_tokens=1: the request is finished too
                return time.perf_counter() - t0


def _decode_step_s(engine, prompts: list[list[int]], new: int, tag: str) -> float:
    from services.engine.types import EngineRequest, SamplingParams

    engine.flush_cache()
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(EngineRequest(rid, list(p), sp))
    got = {r: 0 for r in ids}
    pending, t_first, steps = set(ids), None, 0
    while pending:
        outs = engine.step()
        if t_first is not None:
            steps += 1
        for o in outs:
            got[o.request_id] += len(o.new_token_ids)
            if o.finished:
                pending.discard(o.request_id)
        if t_first is None and all(got.values()):
            t_first = time.perf_counter()
    return (time.perf_counter() - (t_first or time.perf_counter())) / max(1, steps)


def _lstsq(rows: list[tuple[float, float, float]], ys: list[float]) -> tuple[float, float, float]:
    import numpy as np

    sol, *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return tuple(max(0.0, float(x)) for x in sol)  # type: ignore[return-value]


def measure_model(path: Path, name: str, *, lengths, batches, contexts, repeats: int, seed: int, say) -> dict[str, Any]:
    import torch

    from services.engine.executor import Engine

    from talaria.config import EngineConfig

    # the serving engine's chunked-prefill budget (the matrix runs the default), so long prompts are
    # measured as they are served: in chunks whose attention grows with the context
    engine = Engine(path, device="cpu", dtype=torch.float32, model_id=name, max_num_seqs=max(32, max(batches)),
                    max_num_batched_tokens=EngineConfig.model_fields["max_num_batched_tokens"].default)
    rng = random.Random(seed)
    vocab = engine.vocab_size
    longest = engine.max_context - 1  # a prompt and its one output token within the model's context
    if max(lengths) > longest:
        say(f"  {name}: prefill lengths above its context of {engine.max_context} tokens measured at {longest}")
    lengths = sorted({min(n, longest) for n in lengths})
    prompts = {n: [rng.randrange(3, vocab) for _ in range(n)] for n in lengths}
    for n in lengths:
        _first_token_s(engine, prompts[n], f"warm-{n}")
    # repetitions outer, lengths inner: a burst of load on this shared machine slows one repetition of
    # every length instead of every repetition of one length (which bends the fitted exponent)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for r in range(repeats):
        for n in lengths:
            times[n].append(_first_token_s(engine, prompts[n], f"p{n}-{r}"))
    pts = [(n, statistics.median(times[n])) for n in lengths]
    k, p = _fit(pts)
    # the fit's own spread: each repetition fitted alone, its prediction at the probe length
    probe = PREFILL_PROBE_TOKENS
    per_rep = sorted(kr * probe**pr for kr, pr in (_fit([(n, times[n][r]) for n in lengths]) for r in range(repeats)))
    # decode: the same order (repetitions outer, grid points inner), DECODE_TOKENS steps a point
    grid = list(dict.fromkeys((b, min(ctx, longest - DECODE_TOKENS)) for b in batches for ctx in contexts))  # clamped: no point twice
    dprompts = {(b, ctx): [[rng.randrange(3, vocab) for _ in range(ctx)] for _ in range(b)] for b, ctx in grid}
    dtimes: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
    for r in range(repeats):
        for b, ctx in grid:
            dtimes[(b, ctx)].append(_decode_step_s(engine, dprompts[(b, ctx)], DECODE_TOKENS, f"d{b}-{ctx}-{r}"))
    rows = [(1.0, float(b), float(b * ctx)) for b, ctx in grid]
    ys = [statistics.median(dtimes[g]) for g in grid]
    base, per_seq, per_ctx = _lstsq(rows, ys)
    cfg = engine.config
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * engine.dtype.itemsize
    spread = (per_rep[0], per_rep[-1])
    say(f"  {name}: prefill {[(n, round(t, 4)) for n, t in pts]} -> k={k:.3g} p={p:.3f} ({probe} tokens: {k * probe**p * 1e3:.1f} ms, "
        f"repetitions alone {spread[0] * 1e3:.1f}-{spread[1] * 1e3:.1f} ms); decode base {base * 1e3:.2f} ms, "
        f"+{per_seq * 1e3:.3f} ms/seq, +{per_ctx * 1e9:.2f} ms per 1M ctx tokens")
    del engine
    gc.collect()
    return {"prefill_points": [(n, round(t, 6)) for n, t in pts], "prefill_k": k, "prefill_p": p, "prefill_probe_spread_s": spread,
            "decode_base_s": base, "decode_per_seq_s": per_seq, "decode_per_ctx_token_s": per_ctx, "kv_bytes_per_token": kv}


def _fit(pts):
    from sim.profile import fit_power

    return fit_power(pts)


def measure_switch(models_dir: Path, models: tuple[str, ...], switches: int, say) -> tuple[dict[str, float], dict[str, int]]:
    from bench.switch_bench import _stage
    from services.engine.cold.engine import ColdEngine
    from services.engine.substrate.bank import WeightBank

    chunk = 4096 * 1024
    probe = WeightBank(chunk, pin=False)
    sizes = {m: probe.load(m, models_dir / m).nbytes for m in models}
    del probe
    ce = ColdEngine({m: models_dir / m for m in models}, page_size=16, kv_cache_bytes=2 * max(sizes.values()) + (16 << 20), chunk_bytes=chunk, initial=models[0])
    recs: dict[str, list[tuple[float, ...]]] = {"full_staged": [], "host_only": []}
    src, dst = models[0], models[1]
    try:
        for i in range(switches + 1):
            for path in recs:
                if ce.active != src:
                    ce.switch_to(src)
                ce.substrate.area.discard()
                if path == "full_staged":
                    _stage(ce, dst, ce.bank[dst].num_chunks)
                rec = ce.switch_to(dst)
                if i and rec.path == path:  # the first round warms up
                    recs[path].append(rec.phase_seconds)
    finally:
        ce.substrate.copier.close()
    med = {p: [statistics.median(r[j] for r in v) for j in range(5)] for p, v in recs.items() if v}
    h, f = med["host_only"], med.get("full_staged", med["host_only"])
    out = {"save_teardown_s": h[0], "open_h2d_s": h[1], "open_d2d_s": f[1], "restore_kv_shell_s": h[2], "restore_runtime_s": h[3], "publish_s": h[4]}
    say(f"  switch {src}->{dst}: host_only {sum(h) * 1e3:.1f} ms, full_staged {sum(f) * 1e3:.1f} ms")
    return out, sizes


def measure_restore(models_dir: Path, model: str, tokens: int, seed: int, say, repeats: int = 3) -> tuple[float, float]:
    """(restore seconds per token, checkpoint CPU seconds per token) of a ``tokens``-token prefix."""
    from bench.kvstore_bench import run_kvstore_bench

    r = run_kvstore_bench(str(models_dir), model, [tokens], repeats, seed, 1, say=lambda m: None)
    row = r["rows"][0]
    say(f"  restore {tokens} tokens: {row['restore_step_s'] * 1e3:.1f} ms (recompute TTFT {row['recompute_ttft_s'] * 1e3:.1f} ms), "
        f"checkpoint {row['checkpoint_cpu_s'] * 1e3:.1f} ms of CPU")
    return row["restore_step_s"] / tokens, row["checkpoint_cpu_s"] / tokens


def build_profile(args, say=print) -> dict[str, Any]:
    import torch

    from talaria.config import EngineConfig, KvStoreConfig

    torch.set_num_threads(args.threads)
    models = tuple(args.models)
    mdir = ensure_models(args.models_dir, list(models), say=say)
    say(f"measuring {', '.join(models)} on cpu, {torch.get_num_threads()} torch threads, loadavg {_loadavg()}")
    how = f"measured here by `talaria bench profile` (cpu, float32, {args.threads} torch thread(s), median of {args.repeats}, loadavg {_loadavg()})"
    per = {m: measure_model(mdir / m, m, lengths=args.lengths, batches=args.batches, contexts=args.contexts, repeats=args.repeats, seed=args.seed, say=say) for m in models}
    switch, sizes = measure_switch(mdir, models, args.switches, say)
    restore, checkpoint = measure_restore(mdir, models[0], args.restore_tokens, args.seed, say, args.repeats) if args.restore_tokens else (0.0, 0.0)

    def c(v: float, what: str) -> dict[str, Any]:
        return {"value": v, "cite": f"{what}; {how}"}

    ec, kc = EngineConfig.model_fields, KvStoreConfig.model_fields
    kv_mb = 64  # bench matrix base_stack
    models_out = {}
    for m, r in per.items():
        models_out[m] = {
            "prefill_k": c(r["prefill_k"], f"fit of median first-token times {r['prefill_points']}; each repetition fitted alone puts "
                                           f"{PREFILL_PROBE_TOKENS} tokens at {r['prefill_probe_spread_s'][0] * 1e3:.1f}-"
                                           f"{r['prefill_probe_spread_s'][1] * 1e3:.1f} ms"),
            "prefill_p": c(r["prefill_p"], "same fit"),
            "decode_base_s": c(r["decode_base_s"], "least squares over batch x context grid"),
            "decode_per_seq_s": c(r["decode_per_seq_s"], "same fit"), "decode_per_ctx_token_s": c(r["decode_per_ctx_token_s"], "same fit"),
            "restore_per_token_s": c(restore, f"bench kvstore restore step of {args.restore_tokens} tokens ({models[0]})"),
            "checkpoint_per_token_s": c(checkpoint, f"bench kvstore: CPU of checkpointing {args.restore_tokens} tokens ({models[0]}; engine's "
                                                    "checkpoint worker + the store's transfer, on the serving cores of a CPU engine)"),
            "weights_gib": c(sizes[m] / 2**30, "weight bank bytes"), "kv_bytes_per_token": c(r["kv_bytes_per_token"], "2 x layers x KV heads x head dim x 4 B"),
        }
    max_w = max(sizes.values()) / 2**30
    return {
        "format": "talaria-profile/1", "name": "measured-here",
        "source": {"command": "talaria bench profile", "models": list(models), "loadavg": _loadavg(), "measured_unix": f"{time.time():.0f}"},
        "instance": {
            "hbm_gib": c(max_w + kv_mb / 1024, "bench matrix engine: largest catalog model + kv_cache_mb 64 (EngineConfig arena default on CPU)"),
            "arena_fraction": c(1.0, "CPU arena holds exactly weights + KV"),
            "host_kv_gib": c(kc["capacity_mb"].default / 1024, "KvStoreConfig.capacity_mb default"),
            "page_tokens": c(ec["page_size"].default, "EngineConfig.page_size default"),
            "max_batched_tokens": c(ec["max_num_batched_tokens"].default, "EngineConfig.max_num_batched_tokens default"),
        },
        "switch": {k: c(v, "median phase of real ColdEngine switches") for k, v in switch.items()},
        "models": models_out,
        "knobs": {
            "ttft_s": c(ec["slot_ttft_s"].default, "EngineConfig.slot_ttft_s default"), "tpot_s": c(ec["slot_tpot_s"].default, "EngineConfig.slot_tpot_s default"),
            "gamma": c(ec["slot_gamma"].default, "EngineConfig.slot_gamma default"), "tau_s": c(1.0, "PlacementConfig.lease_ttl_s default"),
        },
    }


def main(args) -> int:
    prof = build_profile(args)
    text = yaml.safe_dump(prof, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out} (loadavg {_loadavg()})")
    else:
        print(text)
    return 0


def add_args(p) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), help="catalog (default: the bench matrix's three models)")
    p.add_argument("--models-dir", help="checkpoints (default .talaria/bench-models, synthesized if missing)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help=f"prefill lengths (default {' '.join(map(str, LENGTHS))})")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help=f"decode batch sizes (default {' '.join(map(str, BATCHES))})")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help=f"decode contexts (default {' '.join(map(str, CONTEXTS))})")
    p.add_argument("--restore-tokens", type=int, default=1024, help="host KV restore probe length (0: skip)")
    p.add_argument("--switches", type=int, default=3, help="measured switches per path (default 3)")
    p.add_argument("--repeats", type=int, default=5, help="repetitions (outer loop; medians are used) (default 5)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the profile YAML here (default: stdout)")
