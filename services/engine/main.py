"""Engine process entry: build the executor from config, then serve it on NATS until ``stop``."""

from __future__ import annotations

import asyncio
import logging

from talaria.config import EngineConfig, StackConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def build_engine(stack: StackConfig, cfg: EngineConfig):
    import torch

    from services.engine.executor import Engine

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"engine {cfg.id}: device {cfg.device!r} requested but CUDA is not available")
    if cfg.pool == "cold":
        return build_cold_engine(stack, cfg)
    path = stack.model_path(cfg.models[0])
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"engine {cfg.id}: model {cfg.models[0]!r} not found at {path} (run `talaria models synth --out {stack.models_dir}`)")
    return Engine(
        str(path),
        device=cfg.device,
        dtype=getattr(torch, _DTYPES[cfg.dtype]),
        page_size=cfg.page_size,
        kv_cache_bytes=cfg.kv_cache_mb * 1024 * 1024,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        session_cache_entries=cfg.session_cache_entries,
        model_id=cfg.models[0],
    )


def build_cold_engine(stack: StackConfig, cfg: EngineConfig):
    """A cold-pool executor over every catalog model of ``cfg`` (one active at a time, see cold.py)."""
    import torch

    from services.engine.cold import ColdEngine

    catalog = {}
    for m in cfg.models:
        path = stack.model_path(m)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"engine {cfg.id}: model {m!r} not found at {path} (run `talaria models synth --out {stack.models_dir}`)")
        catalog[m] = path
    arena = cfg.arena_mb * 1024 * 1024 if cfg.arena_mb else None
    if arena is None and cfg.device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(cfg.device))
        arena = int(free * cfg.arena_fraction)
    return ColdEngine(
        catalog,
        device=cfg.device,
        dtype=getattr(torch, _DTYPES[cfg.dtype]),
        page_size=cfg.page_size,
        arena_bytes=arena,
        kv_cache_bytes=cfg.kv_cache_mb * 1024 * 1024,
        runtime_bytes=int(cfg.runtime_mb * 1024 * 1024),
        chunk_bytes=cfg.weight_chunk_kb * 1024,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        session_cache_entries=cfg.session_cache_entries,
        staging=cfg.d2d_staging,
        staging_chunks_per_step=cfg.staging_chunks_per_step,
    )


async def run_engine(stack: StackConfig, cfg: EngineConfig, url: str, stop: asyncio.Event) -> None:
    from services.engine.service import EngineService

    engine = await asyncio.to_thread(build_engine, stack, cfg)
    await EngineService(stack, cfg, engine).run(stop, url)
