"""The CPU prefill attention kernel (services/engine/model/prefill_attn.py) against ATen's flash kernel.

Two modes, both in one process, the paths alternated (the order flips every repetition), medians of
``--repeats``; ``/proc/loadavg`` before and after (a shared machine: say so with any number you quote).

- ``--mode layer``: one layer's attention at SmolLM2-135M's shapes (9 query heads, 3 kv heads, head dim 64,
  bf16, K/V scattered over a pool) for every instruction set the kernel has here, vs what the model runs
  without it (ATen's flash kernel after a gather; two calls merged by log-sum-exp for a chunk after a prefix).
- ``--mode engine``: TTFT through one ``Engine`` of the real model ``--model`` whose ``model.prefill_attention``
  is switched between the kernel and ``None`` (ATen) between runs: a fresh 512-token prompt, a fresh
  2,048-token prompt (one step, ``lone_prefill_tokens`` 2,048), a 232-token return after a cached
  1,500-token prefix, eight fresh 800-token prompts submitted together (time until the last first token).

    Run ``python -m bench.prefill_attn_bench --mode layer|engine [--model PATH] [--threads 2] [--repeats 5]``;
    prints JSON: per case the two medians and their ratio ATen / kernel (> 1: the kernel is faster).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

SHAPES = {"512 fresh": ([512], [512]), "2048 fresh": ([2048], [2048]), "232 after 1500": ([232], [1732]),
          "512 after 1536": ([512], [2048]), "32 after 1968": ([32], [2000]), "8 x 100 fresh": ([100] * 8, [100] * 8)}


def _loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3]


def aten_rows(q, kpool, vpool, slots, q_lens, ctx_lens, scale):
    """The model's path without the kernel: per sequence a gather and one causal flash call, or two merged
    by log-sum-exp for a chunk after its prefix."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    outs, qa, ka = [], 0, 0
    for nq, n in zip(q_lens, ctx_lens):
        kc = kpool.index_select(0, slots[ka : ka + n]).transpose(0, 1)[None]
        vc = vpool.index_select(0, slots[ka : ka + n]).transpose(0, 1)[None]
        qr, p = q[qa : qa + nq].transpose(0, 1)[None], n - nq
        if p == 0:
            o = flash(qr, kc, vc, 0.0, True, scale=scale)[0]
        else:
            o1, l1 = flash(qr, kc[:, :, :p], vc[:, :, :p], 0.0, False, scale=scale)
            o2, l2 = flash(qr, kc[:, :, p:], vc[:, :, p:], 0.0, True, scale=scale)
            o = torch.lerp(o2.float(), o1.float(), torch.sigmoid(l1 - l2).unsqueeze(-1)).to(q.dtype)
        outs.append(o[0].transpose(0, 1))
        qa, ka = qa + nq, ka + n
    return torch.cat(outs)


def _time(fn, n: int = 10) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def layer_mode(repeats: int) -> dict:
    from services.engine.model.prefill_attn import isas, load_prefill_kernel

    paths = {"aten": aten_rows, **{isa: load_prefill_kernel(isa) for isa in isas()}}
    g = torch.Generator().manual_seed(0)
    H, KVH, pool = 9, 3, 8192
    kpool = torch.randn(pool, KVH, 64, generator=g).to(torch.bfloat16)
    vpool = torch.randn(pool, KVH, 64, generator=g).to(torch.bfloat16)
    out = {}
    for name, (q_lens, ctx_lens) in SHAPES.items():
        slots = torch.randperm(pool, generator=g)[: sum(ctx_lens)]
        q = torch.randn(sum(q_lens), H, 64, generator=g).to(torch.bfloat16)
        samples: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(repeats):
            for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                samples[p].append(_time(lambda: paths[p](q, kpool, vpool, slots, q_lens, ctx_lens, 0.125)))
        med = {p: statistics.median(v) * 1e6 for p, v in samples.items()}
        out[name] = {**{f"{p}_us": round(v, 1) for p, v in med.items()},
                     **{f"aten/{p}": round(med["aten"] / med[p], 2) for p in paths if p != "aten"}}
    return out


def _ttft(eng, prompts: list[list[int]], rng: random.Random) -> float:
    """Submit ``prompts`` at once; seconds until the last one's first token."""
    from bench.lone_prefill_bench import first_token_times

    return max(first_token_times(eng, prompts, rng))


def engine_mode(model: str, repeats: int) -> dict:
    from services.engine.executor import Engine

    eng = Engine(model, device="cpu", dtype=torch.bfloat16, max_num_batched_tokens=512, lone_prefill_tokens=2048,
                 kv_cache_bytes=1 << 30)
    kernel = eng.model.prefill_attention
    if kernel is None:
        raise SystemExit("the prefill kernel does not apply here (needs AMX-BF16 or AVX-512 BF16): nothing to compare")
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, eng.vocab_size - 1) for _ in range(n)]

    def case(name: str) -> float:
        eng.flush_cache()
        if name == "512 fresh":
            return _ttft(eng, [tokens(512)], rng)
        if name == "2048 fresh":
            return _ttft(eng, [tokens(2048)], rng)
        if name == "232 after 1500":
            prefix = tokens(1500)
            _ttft(eng, [prefix], rng)  # cached, as an agent's previous call leaves it
            return _ttft(eng, [prefix + tokens(232)], rng)
        return _ttft(eng, [tokens(800) for _ in range(8)], rng)

    names = ["512 fresh", "2048 fresh", "232 after 1500", "8 x 800 fresh"]
    paths = {"aten": None, "kernel": kernel}
    samples = {(n, p): [] for n in names for p in paths}
    case("512 fresh")  # warm-up
    for r in range(repeats):
        for n in names:
            for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                eng.model.prefill_attention = paths[p]
                samples[(n, p)].append(case(n))
    eng.model.prefill_attention = kernel
    out = {}
    for n in names:
        a, k = statistics.median(samples[(n, "aten")]), statistics.median(samples[(n, "kernel")])
        out[n] = {"aten_ms": round(a * 1e3, 1), "kernel_ms": round(k * 1e3, 1), "aten/kernel": round(a / k, 2)}
    return out


def main(argv: list[str] | None = None) -> None:
    from services.engine.model.prefill_attn import isas

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["layer", "engine"], default="layer")
    ap.add_argument("--model", default=".talaria/models/smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    before = _loadavg()
    result = layer_mode(a.repeats) if a.mode == "layer" else engine_mode(a.model, a.repeats)
    print(json.dumps({"mode": a.mode, "isas": isas(), "threads": a.threads, "repeats": a.repeats,
                      "loadavg_before": before, "loadavg_after": _loadavg(), "cases": result}, indent=1))


if __name__ == "__main__":
    main()
