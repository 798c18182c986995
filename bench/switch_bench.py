"""``talaria bench switch``: cold-pool model switch latency by load path vs a full engine reload.

What is measured
    One :class:`~services.engine.cold.ColdEngine` holds two synthesized catalog models in its weight bank:
    a small ``--from`` model (default ``tiny-llama``) and the ``--model`` switched to (default
    ``small-llama``). Each measured switch is ``from → model`` (the way back is not measured) and its
    time is the switch record's ``total_seconds`` (all five phases). Paths:

    * ``full_staged`` — every chunk of the target was staged into the KV tail while ``from`` was active:
      the switch gathers it device-to-device;
    * ``partial`` — only the first half of the chunks was staged: D2D for those, the rest from the bank;
    * ``host_only`` — nothing staged: every chunk is copied from the host weight bank;
    * ``reload`` — what a stock engine does: build an ``Engine`` from the checkpoint files (safetensors
      read + parameter copy + KV pool allocation + tokenizer).

    Plus the physical limit of this machine: a plain ``Tensor.copy_`` of the same number of bytes between
    two preallocated host tensors, reported as bytes/s next to the host-only path's H2D bytes/s.

    On a CPU-only machine "device" memory is host memory, so D2D and H2D are both memcpy: the staged
    paths cannot beat host-only here (they show the mechanism's overhead); the reload ratio is the
    meaningful speed-up. On CUDA, D2D runs at HBM bandwidth and H2D at PCIe bandwidth.

How it is reported
    ``--switches`` measured switches per path per repetition, paths interleaved (one switch of each path
    in turn) so drift hits all alike; per repetition p50/p95 per path; the table shows the median over
    ``--repeats`` repetitions and the ratios of p50s (reload / path, host_only / path).
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any

import torch

from bench import ensure_models, format_table, median, percentile

PATHS = ("full_staged", "partial", "host_only", "reload")


def _stage(ce, target: str, chunks: int) -> None:
    sub = ce.substrate
    for _ in range(10_000):
        sub.stage(target, chunks)
        sub.area.poll(wait=True)
        if sum(1 for (m, _), c in sub.area.by_index.items() if m == target and c.state.value == "clean") >= chunks:
            return
        if not sub.staging_pending(target):
            break
    raise RuntimeError(f"could not stage {chunks} chunks of {target} (KV region too small?)")


def run_once(ce, engine_kw: dict, src: str, dst: str, switches: int) -> dict[str, Any]:
    from services.engine.executor import Engine

    n_chunks = ce.bank[dst].num_chunks
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    h2d_rates: list[float] = []
    for _ in range(switches):
        for path in PATHS:
            if ce.active != src:
                ce.switch_to(src)
            ce.substrate.area.discard()
            if path == "reload":
                gc.collect()
                t0 = time.perf_counter()
                eng = Engine(ce.catalog[dst], model_id=dst, **engine_kw)
                times[path].append(time.perf_counter() - t0)
                del eng
                continue
            if path == "full_staged":
                _stage(ce, dst, n_chunks)
            elif path == "partial":
                _stage(ce, dst, max(1, n_chunks // 2))
            rec = ce.switch_to(dst)
            if rec.path != path:
                raise RuntimeError(f"expected a {path} switch, got {rec.path}")
            times[path].append(rec.total_seconds)
            if path == "host_only" and rec.h2d_seconds > 0:
                h2d_rates.append(rec.host_bytes / rec.h2d_seconds)
    nbytes = ce.bank[dst].nbytes
    src_t = ce.bank[dst].host.clone()
    dst_t = torch.empty_like(src_t)
    dst_t.copy_(src_t)  # first touch
    copies = []
    for _ in range(switches):
        t0 = time.perf_counter()
        dst_t.copy_(src_t)
        copies.append(time.perf_counter() - t0)
    out = {p: {"p50": percentile(v, 50), "p95": percentile(v, 95)} for p, v in times.items()}
    out["h2d_bytes_per_s"] = median(h2d_rates)
    out["copy_bytes_per_s"] = nbytes / median(copies)
    return out


def main(args) -> int:
    from services.engine.cold.engine import ColdEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    models_dir = ensure_models(args.models_dir, [args.src, args.model], seed=args.seed)
    say = print
    chunk = args.chunk_kb * 1024
    # the KV region must hold the whole target in its tail (full staging) above the target's weights
    from services.engine.substrate.bank import WeightBank

    probe = WeightBank(chunk, pin=False)
    w = max(probe.load(m, models_dir / m).nbytes for m in (args.src, args.model))
    del probe
    kv_bytes = 2 * w + (16 << 20)
    device = getattr(args, "device", "cpu")
    ce = ColdEngine({args.src: models_dir / args.src, args.model: models_dir / args.model}, page_size=16, kv_cache_bytes=kv_bytes, chunk_bytes=chunk, initial=args.src, device=device)
    engine_kw = dict(page_size=16, kv_cache_bytes=kv_bytes, device=device)
    wb = ce.bank[args.model].nbytes
    say(f"switch {args.src} -> {args.model}: {wb / 2**20:.1f} MiB of weights in {ce.bank[args.model].num_chunks} chunks of {args.chunk_kb} KiB; arena {ce.arena.capacity / 2**20:.0f} MiB; torch threads {torch.get_num_threads()}")
    run_once(ce, engine_kw, args.src, args.model, 2)  # warm-up
    runs = []
    for r in range(args.repeats):
        runs.append(run_once(ce, engine_kw, args.src, args.model, args.switches))
        say(f"  repetition {r + 1}/{args.repeats} done")
    med = {p: {q: median([run[p][q] for run in runs]) for q in ("p50", "p95")} for p in PATHS}
    rows = []
    for p in PATHS:
        rows.append([
            p, med[p]["p50"] * 1e3, med[p]["p95"] * 1e3,
            median([run["reload"]["p50"] / run[p]["p50"] for run in runs]),
            median([run["host_only"]["p50"] / run[p]["p50"] for run in runs]),
        ])
    say("")
    say(format_table(["path", "p50 ms", "p95 ms", "reload/path", "host_only/path"], rows))
    h2d = median([run["h2d_bytes_per_s"] for run in runs])
    cp = median([run["copy_bytes_per_s"] for run in runs])
    say("")
    say(format_table(["copy", "GB/s", "vs plain copy"], [["host_only H2D phase", h2d / 1e9, h2d / cp], ["plain Tensor.copy_", cp / 1e9, 1.0]]))
    say(f"\n(median of {args.repeats} repetitions x {args.switches} switches per path; CPU: D2D and H2D are both memcpy)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median": med, "weight_bytes": wb}, f, indent=2)
    ce.substrate.copier.close()
    return 0
