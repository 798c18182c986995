"""kvstore process entry: ``talaria kvstore --config FILE`` / ``python -m services.kvstore``."""

from __future__ import annotations

import logging
import signal
import threading

from talaria.config import KvStoreConfig

log = logging.getLogger(__name__)


def run_kvstore(cfg: KvStoreConfig, stop: threading.Event | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or ``stop``). Prints ``kvstore listening on HOST:PORT`` when ready."""
    from services.kvstore.server import KvStoreServer

    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    server = KvStoreServer(cfg)
    server.start()
    print(
        f"kvstore pool {cfg.capacity_mb} MiB in {cfg.slab_kb} KiB slabs, eviction {cfg.eviction}, "
        f"data plane mooncake/{cfg.protocol} at {server.mooncake.name}", flush=True,
    )
    print(f"kvstore listening on {server.address}", flush=True)
    try:
        stop.wait()
    finally:
        server.stop()
    return 0
