"""Paged decode attention kernel (services/engine/model/paged_attn.py) vs gather + SDPA, on the CPU.

What is measured (one process, the kernel built before any timing)
    * ``--mode layer``: one layer's decode attention (``Attention._attend`` of the decode group, SmolLM2-135M
      shapes: 9 query heads, 3 KV heads, head dim 64, page 16) at batch ``--batch`` and each context length
      of ``--lens``, pages scattered over the pool: the kernel vs the padded gather + masked SDPA, in blocks of
      ``--block`` calls alternated ``--repeats`` times; median per call in microseconds and the kernel's K/V
      read rate. Each call of a block reads the next of ``--layers`` layers' pools (default 30, SmolLM2's
      count), so the K/V come from memory as in a decode step; ``--layers 1`` repeats one layer, whose K/V
      (11 MB at batch 8 x 1,800 keys) then stay in this CPU's 32 MB L3 -- that measured 30 GB/s where a
      decode step gets half (2026-12-05; ``paged_attn.py``);
    * ``--mode step``: whole decode steps (``Engine.step()``) of the real model ``--model`` with ``--batch``
      prompts of ``--prompt`` tokens prefilled first, the kernel switched on and off step by step
      (``model.paged_decode``), ``--steps`` steps each; median step time in milliseconds.

    Run ``python -m bench.paged_attn_bench --mode layer|step [--threads 2] [--dtype bfloat16]``; prints JSON
    with ``/proc/loadavg`` before and after (a shared machine: say so with any number you quote).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from services.engine.model.batch import AttnBatch
from services.engine.model.config import ModelConfig
from services.engine.model.llama import Attention, _AttnPlan
from services.engine.model.paged_attn import load_kernel


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def _time(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def layer_mode(batch: int, lens: list[int], dtype: torch.dtype, block: int, repeats: int, layers: int = 30) -> dict:
    kernel = load_kernel()
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_attention_heads": 9,
                                 "num_key_value_heads": 3, "num_hidden_layers": 1, "intermediate_size": 1536,
                                 "vocab_size": 256, "max_position_embeddings": 8192})
    attn = Attention(cfg).to(dtype)
    page, res = 16, {}
    g = torch.Generator().manual_seed(0)
    for L in lens:
        pages_each = -(-L // page)
        num_pages = batch * pages_each + 8
        perm = torch.randperm(num_pages, generator=g).tolist()
        tables = [perm[i * pages_each : (i + 1) * pages_each] for i in range(batch)]
        ks = [torch.randn(num_pages * page, 3, 64, generator=g).to(dtype) for _ in range(layers)]
        vs = [torch.randn(num_pages * page, 3, 64, generator=g).to(dtype) for _ in range(layers)]
        k, v = ks[0], vs[0]
        q = torch.randn(batch, 9, 64, generator=g).to(dtype)
        ab = AttnBatch(list(range(batch + 1)), [L] * batch, tables, torch.zeros(batch, dtype=torch.long))
        plans = {"kernel": _AttnPlan(ab, page, batch, torch.device("cpu"), None, kernel),
                 "gather_sdpa": _AttnPlan(ab, page, batch, torch.device("cpu"), None, None)}
        ref = attn._attend(q, k, v, plans["gather_sdpa"].single, whole=True).float()
        err = (attn._attend(q, k, v, plans["kernel"].single, whole=True).float() - ref).abs().max().item()
        times: dict[str, list[float]] = {name: [] for name in plans}
        nxt = itertools.count()
        for _ in range(repeats):
            for name, plan in plans.items():
                def call(plan=plan):
                    i = next(nxt) % layers  # the next layer's pool: out of cache, as in a decode step
                    return attn._attend(q, ks[i], vs[i], plan.single, whole=True)
                times[name] += _time(call, block)
        med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        kv_bytes = 2 * batch * L * 3 * 64 * ks[0].element_size()
        res[f"L={L}"] = {"kernel_us": round(med["kernel"], 1), "gather_sdpa_us": round(med["gather_sdpa"], 1),
                         "speedup": round(med["gather_sdpa"] / med["kernel"], 2), "max_abs_err": err,
                         "kernel_kv_gb_s": round(kv_bytes / med["kernel"] / 1e3, 1)}
    return res


def step_mode(model_dir: str, batch: int, prompt: int, steps: int, dtype: torch.dtype) -> dict:
    from services.engine.executor import Engine
    from services.engine.types import EngineRequest, SamplingParams

    # a sequence whose prefill ends first decodes during the others' prefill steps: room for those tokens
    max_tokens = 2 * steps + 16 + batch * prompt // 256
    eng = Engine(model_dir, dtype=dtype, page_size=16, max_num_seqs=batch, max_num_batched_tokens=512,
                 num_pages=batch * -(-(prompt + 7 * batch + max_tokens) // 16) + 16, paged_decode="auto")
    kernel = eng.model.paged_decode
    assert kernel is not None, "the kernel did not build"
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(100, eng.vocab_size - 100, (prompt + i * 7,), generator=g).tolist()
        eng.add_request(EngineRequest(f"r{i}", ids, sp))
    while sum(s.num_computed_tokens >= s.num_prompt_tokens for s in eng.scheduler.running) < batch:
        eng.step()  # prefill (the sequences are in the scheduler after the first step's intake)
    for _ in range(2):
        eng.step()  # warm both paths
    times: dict[str, list[float]] = {"kernel": [], "gather_sdpa": []}
    for i in range(2 * steps):
        name = "kernel" if i % 2 == 0 else "gather_sdpa"
        eng.model.paged_decode = kernel if name == "kernel" else None
        t = time.perf_counter()
        eng.step()
        times[name].append(time.perf_counter() - t)
        assert len(eng.scheduler.running) == batch, (i, len(eng.scheduler.running), eng.scheduler.num_waiting, eng.max_context)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"kernel_ms": round(med["kernel"], 2), "gather_sdpa_ms": round(med["gather_sdpa"], 2),
            "speedup": round(med["gather_sdpa"] / med["kernel"], 3), "steps_each": steps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("layer", "step"), default="layer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lens", default="256,2000")
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layers", type=int, default=30, help="layer mode: pools rotated through (1 = one layer's K/V, cache-hot)")
    ap.add_argument("--model", default=".talaria/models/smollm2-135m-instruct")
    ap.add_argument("--prompt", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    load_kernel()  # build (or load from the cache) before anything is timed
    before = _loadavg()
    if a.mode == "layer":
        res = layer_mode(a.batch, [int(x) for x in a.lens.split(",")], dtype, a.block, a.repeats, a.layers)
    else:
        res = step_mode(a.model, a.batch, a.prompt, a.steps, dtype)
    print(json.dumps({"mode": a.mode, "threads": a.threads, "dtype": a.dtype, "batch": a.batch,
                      **({"layers": a.layers} if a.mode == "layer" else {}), "result": res,
                      "loadavg_before": before, "loadavg_after": _loadavg()}, indent=1))


if __name__ == "__main__":
    main()
