"""A lone prefill in one step (``lone_prefill_tokens``, services/engine/scheduler.py) vs 512-token chunks.

What is measured (one process, two ``Engine`` s of the real model ``--model`` that differ only in
``lone_prefill_tokens``: 0 and ``--lone``; both ``max_num_batched_tokens`` ``--budget``): TTFT of each case --
one prompt of 2,048 tokens, one of 1,024, eight of 800 submitted together (mean and max over the eight) --
alternating the two engines (the order flips every repetition), ``--repeats`` repetitions, prefix caches
flushed before each run; medians and the ratio off / on (> 1: the lone chunk is faster).

    Run ``python -m bench.lone_prefill_bench [--model PATH] [--threads 2] [--repeats 3]``; prints JSON with
    ``/proc/loadavg`` before and after (a shared machine: say so with any number you quote).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from services.engine.executor import Engine
from services.engine.types import EngineRequest, SamplingParams

CASES = {"1x2048": [2048], "1x1024": [1024], "8x800": [800] * 8}


def _loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3]


def ttfts(eng: Engine, lens: list[int], rng: random.Random) -> list[float]:
    """Submit prompts of ``lens`` tokens at once (prefix caches flushed first); seconds from submission to
    each one's first token."""
    eng.flush_cache()
    return first_token_times(eng, [[rng.randrange(100, eng.vocab_size - 1) for _ in range(n)] for n in lens], rng)


def first_token_times(eng: Engine, prompts: list[list[int]], rng: random.Random) -> list[float]:
    """Submit ``prompts`` at once (greedy, 2 tokens each) and step the engine until all finish; seconds from
    submission to each one's first token. Mutates the engine (its caches keep the prompts)."""
    t0, first = time.perf_counter(), {}
    for prompt in prompts:
        eng.add_request(EngineRequest(f"r{rng.getrandbits(48)}", prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
    return list(first.values())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".talaria/models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--lone", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    before = _loadavg()
    engines = {lone: Engine(a.model, device="cpu", dtype=getattr(torch, a.dtype), max_num_batched_tokens=a.budget,
                            lone_prefill_tokens=lone, kv_cache_bytes=1 << 30) for lone in (0, a.lone)}
    rng = random.Random(0)
    for e in engines.values():  # warm-up: allocator, kernels
        ttfts(e, [600], rng)
        ttfts(e, [2048], rng)
    res: dict[tuple[int, str], list[list[float]]] = {(lone, c): [] for lone in engines for c in CASES}
    for rep in range(a.repeats):
        for c, lens in CASES.items():
            order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
            for lone, e in order:
                res[(lone, c)].append(ttfts(e, lens, rng))
    rows = []
    for c in CASES:
        for stat, f in (("mean", statistics.mean), ("max", max)):
            off = statistics.median(f(x) for x in res[(0, c)])
            on = statistics.median(f(x) for x in res[(a.lone, c)])
            rows.append({"case": c, "ttft": stat, "off_ms": round(off * 1e3, 1), "on_ms": round(on * 1e3, 1), "off_over_on": round(off / on, 3)})
    print(json.dumps({"model": a.model, "dtype": a.dtype, "threads": a.threads, "budget": a.budget, "lone": a.lone,
                      "repeats": a.repeats, "rows": rows, "loadavg_before": before, "loadavg_after": _loadavg()}, indent=1))


if __name__ == "__main__":
    main()
