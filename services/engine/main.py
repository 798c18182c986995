"""Engine process entry: build the executor from config, then serve it on NATS until ``stop``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from talaria.config import EngineConfig, StackConfig

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from services.engine.cold.engine import ColdEngine
    from services.engine.kv.port import KvPort
    from services.engine.executor import Engine

T = TypeVar("T")

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005


def torch_threads(cfg: EngineConfig) -> int:
    """Intra-op threads: ``torch_threads`` from config, default every core this process may run on."""
    import os

    return cfg.torch_threads or len(os.sched_getaffinity(0))


def build_engine(stack: StackConfig, cfg: EngineConfig) -> Engine | ColdEngine:
    """The executor ``cfg`` describes: the hot ``Engine`` or, for a cold pool, ``build_cold_engine``'s.
    ``run_engine`` hands it to ``EngineService`` as an ``api.Executor``, so the type checker verifies both
    engines satisfy that protocol (and, through ``Executor.pool``, the cold engine ``api.ModelPool``)."""
    import torch

    from services.engine.executor import Engine
    from services.engine.settings import EngineSettings

    torch.set_num_threads(torch_threads(cfg))
    if cfg.tune_allocator:  # before the weights and the first step allocate (allocator_tuning.py)
        from services.engine.allocator_tuning import tune_allocator

        tune_allocator()
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"engine {cfg.id}: device {cfg.device!r} requested but CUDA is not available")
    if cfg.device.startswith("cpu"):
        # build (or load from torch's extension cache) the CPU kernels now, before the engine is ready: built
        # lazily they would land in the first model's first activation, and the cold engine would learn a
        # one-time compile (~1 min on 2 cores) as its switch cost (every policy priced a switch at
        # a minute until enough real switches washed it out)
        from services.engine.model.paged_attn import load_extension

        t0 = time.perf_counter()
        ok = load_extension() is not None
        log.info("engine %s: CPU kernels %s in %.1f s", cfg.id, "ready" if ok else "unavailable (eager paths)", time.perf_counter() - t0)
    if cfg.pool == "cold":
        return build_cold_engine(stack, cfg)
    path = stack.model_path(cfg.models[0])
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"engine {cfg.id}: model {cfg.models[0]!r} not found at {path} (run `talaria models synth --out {stack.models_dir}`)")
    return Engine(str(path), EngineSettings.from_config(cfg, torch_threads(cfg)), model_id=cfg.models[0])


def build_cold_engine(stack: StackConfig, cfg: EngineConfig) -> ColdEngine:
    """A cold-pool executor over every catalog model of ``cfg`` (one active at a time, see cold/engine.py)."""
    import torch

    from services.engine.cold.engine import ColdEngine
    from services.engine.settings import EngineSettings

    extra: dict[str, Any] = {}
    if cfg.slot_scheduler:  # rounds/slots with SP (Talaria §3.4) instead of the switch-when-idle rule
        from services.engine.cold.slotted import SlotSwitching, policy_from_config

        extra["switching"] = SlotSwitching(policy_from_config(cfg))
    if cfg.unified_residency:  # one device budget for staged layer groups and session KV prefixes
        from services.engine.cold.residency import ResidencyDriver

        extra["residency"] = ResidencyDriver(chunks_per_step=cfg.staging_chunks_per_step)
    catalog: dict[str, str | Path] = {}
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
        EngineSettings.from_config(cfg, torch_threads(cfg)),  # kv_cache_bytes None: the arena's default KV share
        **extra,
        arena_bytes=arena,
        runtime_bytes=int(cfg.runtime_mb * 1024 * 1024),
        chunk_bytes=cfg.weight_chunk_kb * 1024,
        staging=cfg.d2d_staging,
        staging_chunks_per_step=cfg.staging_chunks_per_step,
        partial_layers=cfg.partial_layers,
        weight_link_bytes_per_s=cfg.weight_link_mb_s * 1e6 if cfg.weight_link_mb_s is not None else None,
    )


def attach_host_kv(stack: StackConfig, cfg: EngineConfig, engine: Engine | ColdEngine, tracer: Tracer | None = None) -> bool:
    """Give the engine a host KV tier on the node's kvstore when configured (``host_kv`` and
    ``kvstore.enabled``). The store is an optimization: if it cannot be set up the engine serves without.
    ``tracer`` (the engine process's) records the tier's restore / checkpoint spans."""
    kvs = stack.kvstore
    if not (cfg.host_kv and kvs.enabled):
        return False
    if not kvs.port:
        log.warning("engine %s: host_kv is on but kvstore.port is 0 (only `talaria up` fills it in); serving without", cfg.id)
        return False
    try:
        from services.engine.host_kv import HostKV
        from services.kvstore.client import KvStoreClient, MooncakeEndpoint, channel_credentials  # the store's public API

        client = KvStoreClient(
            f"{kvs.host}:{kvs.port}", timeout_s=kvs.rpc_timeout_s, max_message_mb=kvs.max_message_mb,
            auth_token=kvs.auth_token, credentials=channel_credentials(kvs),
        )
        mooncake = MooncakeEndpoint(kvs.data_host, kvs.protocol)  # one transfer engine per process

        def make_tier(port: KvPort) -> HostKV:
            return HostKV(
                port, client, mooncake=mooncake, retry_after_s=kvs.retry_after_s,
                restore_per_token_prior=kvs.restore_per_token_s, owner=cfg.id, tracer=tracer,
                write_policy=cfg.host_kv_write_policy, mode=cfg.host_kv_restore,
            )

        from services.engine.cold.engine import ColdEngine

        if isinstance(engine, ColdEngine):  # one tier per catalog model; the switch barrier drains the outgoing model's copies
            engine.attach_host_kv_factory(make_tier)
            log.info("engine %s: host KV tier for %d catalog models on kvstore %s:%d", cfg.id, len(cfg.models), kvs.host, kvs.port)
            return True
        tier, hot = make_tier(engine.kv_port()), engine
    except Exception as e:  # noqa: BLE001 - e.g. Mooncake not installable here
        log.warning("engine %s: host KV tier disabled: %s", cfg.id, e)
        return False
    hot.attach_host_kv(tier)
    log.info("engine %s: host KV tier on kvstore %s:%d (model key %s)", cfg.id, kvs.host, kvs.port, tier.layout.model)
    return True


OWNED_SPIN = 300_000  # libgomp's own default: the team spins through the ~150 barriers of a decode step
SHARED_SPIN = 1_000  # sleeps soon: a descheduled team member does not cost the others a time slice per barrier


def spin_count_for(stack: StackConfig, cfg: EngineConfig) -> int:
    """``cfg.omp_spin_count``, with ``auto`` resolved: the fast spin when this is the stack's only CPU engine
    (it owns the host's cores, as a one-engine node does), the robust one when several CPU engines of the stack
    share them (README, Threads: a spinning team collapses beside busy work). Pure."""
    if cfg.omp_spin_count != "auto":
        return int(cfg.omp_spin_count)
    cpu_engines = [e for e in stack.engines if not e.device.startswith("cuda")]
    return OWNED_SPIN if len(cpu_engines) <= 1 else SHARED_SPIN


def omp_spin_count(count: int) -> None:
    """Set ``GOMP_SPINCOUNT`` (mutates ``os.environ``) for the OpenMP runtime torch loads, unless the
    environment already sets it or ``OMP_WAIT_POLICY``; libgomp reads it once, when torch is first imported,
    so a later call only warns. Why and the measured trade-off: README, Threads."""
    import os
    import sys

    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        log.info("OpenMP spin from the environment: GOMP_SPINCOUNT=%s OMP_WAIT_POLICY=%s",
                 os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
        return
    if "torch" in sys.modules:
        log.warning("omp_spin_count %d not applied: torch was already imported in this process", count)
        return
    os.environ["GOMP_SPINCOUNT"] = str(count)


async def in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread that exits when it returns (not the loop's reusable executor threads). torch's
    OpenMP runtime (libgomp) keeps a pool of worker threads per thread that ran a parallel region; once the
    process holds more of them than it has cores, every barrier sleeps and wakes instead of spinning (measured:
    a batch-8 decode step 41 ms instead of 24). Loading the model on a thread that then exits frees its pool,
    so only the executor thread's team remains."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        def fail(err: BaseException) -> None:
            if not fut.done():
                fut.set_exception(err)

        def done(res: T) -> None:
            if not fut.done():
                fut.set_result(res)

        try:
            res = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine (passed now: the name
            loop.call_soon_threadsafe(fail, e)  # dies with the block)
        else:
            loop.call_soon_threadsafe(done, res)

    t = threading.Thread(target=run, name="engine-build", daemon=True)
    t.start()
    try:
        return await fut
    finally:  # returned or raised: the thread (and its OpenMP pool) is gone before the caller goes on
        await asyncio.to_thread(t.join)


async def run_engine(stack: StackConfig, cfg: EngineConfig, url: str, stop: asyncio.Event) -> None:
    import sys

    from services.engine.service import EngineService
    from talaria import otel

    # The step thread holds the GIL between torch ops; the loop thread that publishes tokens would wait up to
    # the default 5 ms switch interval for it. 0.5 ms bounds that wait (see streaming.py).
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    omp_spin_count(spin_count_for(stack, cfg))
    # one Telemetry for the process: the service's call spans and the host KV tier's spans share it
    tel = otel.setup("talaria-engine", cfg.id, stack.telemetry, stack.namespace)
    try:
        engine = await in_own_thread(build_engine, stack, cfg)
        await asyncio.to_thread(attach_host_kv, stack, cfg, engine, tel.tracer)

        await EngineService(stack, cfg, engine, telemetry=tel, requester_probe_s=cfg.requester_probe_s).run(stop, url)
    finally:
        await asyncio.to_thread(tel.shutdown)  # bounded by telemetry.export_timeout_s
