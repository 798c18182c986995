"""``talaria bench kvstore``: restore a session prefix from the host KV store vs recompute it.

What is measured (one process, one run, everything side by side)
    A kvstore server runs in this process (real gRPC control API, real Mooncake TCP data plane on
    loopback); one ``Engine`` (default ``tiny-llama``, float32, CPU, page 16) has a ``HostKV`` tier on it.
    The model's ``config.json`` is copied with ``max_position_embeddings`` raised to 32768 so that 16K-token
    prefixes fit (random weights: only the cost matters). For each prefix length (default 1K, 4K, 16K
    tokens) a prompt of random tokens is served once as a session call, its checkpoint drained into the
    store, and then, ``repeats`` times, alternately:

    * **recompute**: device caches flushed, the tier in ``never`` mode: the prompt is prefilled from
      scratch; time to first token (TTFT);
    * **restore**: device caches flushed, the tier in ``always`` mode: the prefix is looked up, pulled over
      Mooncake into staging, scattered into fresh device pages, and only the last partial page plus the
      final token are prefilled; TTFT, and the restore step alone (``HostKV.restore_blocking``).

    Bandwidth, for the same byte count as the prefix's KV: restore (bytes / restore step), a raw Mooncake
    TCP read of one contiguous range from the store's pool, and a plain ``torch`` copy into a preallocated
    host tensor.

How it is reported
    Medians over the repetitions; ratios (recompute / restore TTFT, restore bandwidth / Mooncake raw,
    restore bandwidth / memcpy) are medians of per-repetition ratios. The first tokens of the two paths are
    compared (they must be equal).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from bench import emit, ensure_models, format_table, median

DEFAULT_MODEL = "tiny-llama"
LONG_CONTEXT = 32768


def long_context_copy(src: Path, dst: Path, max_pos: int = LONG_CONTEXT) -> Path:
    """A copy of checkpoint ``src`` whose config allows ``max_pos`` positions (weights hard-linked)."""
    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "config.json":
            continue
        try:
            (dst / f.name).hardlink_to(f)
        except OSError:
            shutil.copyfile(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = max_pos
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _checkpoint_cpu_s(engine, prompt: list[int], tag: str) -> float:
    """CPU seconds (every thread of this process: the engine's checkpoint worker, the in-process store and its
    Mooncake transfer) that checkpointing ``prompt``'s KV costs: one call with a new session and its checkpoint
    drained, minus the same call without a session (nothing checkpointed). ``prompt`` must be new to the store
    (pages are content-addressed: a known prefix is not transferred again). Steps the engine."""
    engine.flush_cache()
    c0 = time.process_time()
    _ttft(engine, f"plain-{tag}", prompt, "")
    plain = time.process_time() - c0
    engine.flush_cache()
    c0 = time.process_time()
    _ttft(engine, f"ck-{tag}", prompt, f"ck-{tag}")
    assert engine.drain_checkpoints(timeout=120)
    return max(0.0, time.process_time() - c0 - plain)


def _ttft(engine, rid: str, prompt: list[int], session: str) -> tuple[float, int]:
    from services.engine.types import EngineRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(EngineRequest(rid, prompt, sp, session_id=session))
    while True:
        for o in engine.step():
            if o.request_id == rid and o.new_token_ids:
                dt = time.perf_counter() - t0
                while engine.has_unfinished():
                    engine.step()
                return dt, o.new_token_ids[0]


def run_kvstore_bench(
    models_dir: str | None, model: str, lengths: list[int], repeats: int, seed: int, threads: int | None, say=print,
    device: str = "cpu",
) -> dict[str, Any]:
    import torch

    from services.engine.executor import Engine
    from services.engine.host_kv import HostKV
    from services.engine.sequence import Sequence
    from services.kvstore.client import KvStoreClient
    from services.kvstore.server import KvStoreServer
    from services.kvstore.transfer import Copy, HostBuffer, MooncakeEndpoint
    from talaria.config import KvStoreConfig

    if threads:
        torch.set_num_threads(threads)
    base = ensure_models(models_dir, [model], say=say)
    path = long_context_copy(base / model, base / f"{model}-{LONG_CONTEXT // 1024}k")
    page = 16
    max_len = max(lengths)
    engine = Engine(path, device=device, page_size=page, num_pages=(max_len // page) * 2 + 64, max_num_batched_tokens=2048, model_id=model)
    page_bytes = 2 * engine.config.num_hidden_layers * page * engine.config.num_key_value_heads * engine.config.head_dim * engine.dtype.itemsize
    need = (max_len // page + 1) * page_bytes
    store = KvStoreServer(KvStoreConfig(capacity_mb=max(64, 2 * need // 2**20 + 16), slab_kb=max(4, page_bytes // 1024)))
    store.start()
    mc = MooncakeEndpoint()
    hk = HostKV(engine.kv_port(), KvStoreClient(store.address, timeout_s=30), mooncake=mc, staging_bytes=min(need, 256 << 20), mode="always")
    engine.attach_host_kv(hk)
    local = HostBuffer(need, touch=True)
    mc.register(local.address, need)
    say(f"model {model} (max context {engine.max_context}), page {page} tokens = {page_bytes} B, "
        f"store at {store.address} (mooncake {store.mooncake.name}), torch threads {torch.get_num_threads()}")

    rng = random.Random(seed)
    rows = []
    try:
        for n in lengths:
            prompt = [rng.randrange(3, engine.vocab_size) for _ in range(n + 1)]
            nbytes = (n // page) * page_bytes
            hk.mode = "always"
            _ttft(engine, f"warm-{n}", prompt, f"s{n}")  # prefill once, checkpoint the session
            assert engine.drain_checkpoints(timeout=120)
            rec, res, step, bw, mc_bw, cp_bw, r_speed, r_mc, r_cp, same, ck = [], [], [], [], [], [], [], [], [], [], []
            src = torch.empty(nbytes, dtype=torch.uint8)
            src.fill_(1)
            dst = torch.empty(nbytes, dtype=torch.uint8)
            dst.fill_(0)
            for rep in range(repeats):
                engine.flush_cache()
                hk.mode = "never"
                t_rec, tok_rec = _ttft(engine, f"rec-{n}-{rep}", prompt, "")
                engine.flush_cache()
                hk.mode = "always"
                t_res, tok_res = _ttft(engine, f"res-{n}-{rep}", prompt, "")
                engine.flush_cache()
                seq = Sequence(f"probe-{n}-{rep}", prompt)
                t0 = time.perf_counter()
                pages = hk.restore_blocking(seq)
                t_step = time.perf_counter() - t0
                assert pages == n // page, f"restored {pages} pages, expected {n // page}"
                # raw Mooncake TCP read of the same bytes, one contiguous range of the store's pool
                t0 = time.perf_counter()
                mc.read(store.mooncake.name, [Copy(local.address, store.pool.address, nbytes)])
                t_mc = time.perf_counter() - t0
                t0 = time.perf_counter()
                dst.copy_(src)
                t_cp = time.perf_counter() - t0
                gib = nbytes / 2**30
                rec.append(t_rec), res.append(t_res), step.append(t_step)
                bw.append(gib / t_step), mc_bw.append(gib / t_mc), cp_bw.append(gib / t_cp)
                r_speed.append(t_rec / t_res), r_mc.append((gib / t_step) / (gib / t_mc)), r_cp.append((gib / t_step) / (gib / t_cp))
                same.append(tok_rec == tok_res)
                fresh = [rng.randrange(3, engine.vocab_size) for _ in range(n + 1)]  # pages the store does not hold yet
                ck.append(_checkpoint_cpu_s(engine, fresh, f"{n}-{rep}"))
            row = {
                "prefix_tokens": n, "kv_bytes": nbytes,
                "recompute_ttft_s": median(rec), "restore_ttft_s": median(res), "speedup": median(r_speed),
                "restore_step_s": median(step), "restore_gib_s": median(bw), "mooncake_tcp_gib_s": median(mc_bw),
                "memcpy_gib_s": median(cp_bw), "restore_vs_mooncake": median(r_mc), "restore_vs_memcpy": median(r_cp),
                "same_first_token": all(same), "checkpoint_cpu_s": median(ck),
            }
            rows.append(row)
            say(f"  {n} tokens: recompute {row['recompute_ttft_s']:.3f}s, restore {row['restore_ttft_s']:.3f}s")
    finally:
        hk.close()
        mc.close()
        store.stop()
    return {"model": model, "page_size": page, "page_bytes": page_bytes, "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "rows": rows}


def render(result: dict[str, Any]) -> str:
    head = (f"kvstore restore vs recompute — {result['model']}, page {result['page_size']} tokens "
            f"({result['page_bytes']} B), medians of {result['repeats']}, torch threads {result['torch_threads']}")
    headers = ["prefix", "KV MiB", "recompute TTFT s", "restore TTFT s", "speedup x", "restore step s",
               "restore GiB/s", "mooncake TCP GiB/s", "memcpy GiB/s", "restore/mooncake", "restore/memcpy", "same token"]
    rows = [[r["prefix_tokens"], r["kv_bytes"] / 2**20, r["recompute_ttft_s"], r["restore_ttft_s"], r["speedup"],
             r["restore_step_s"], r["restore_gib_s"], r["mooncake_tcp_gib_s"], r["memcpy_gib_s"],
             r["restore_vs_mooncake"], r["restore_vs_memcpy"], "yes" if r["same_first_token"] else "NO"]
            for r in result["rows"]]
    return head + "\n" + format_table(headers, rows)


def main(args) -> int:
    result = run_kvstore_bench(args.models_dir, args.model or DEFAULT_MODEL, args.lengths, args.repeats, args.seed, args.threads,
                               device=getattr(args, "device", "cpu"))
    return emit(result, render(result), args.json)
