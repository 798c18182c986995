"""kvstore process entry: ``talaria kvstore --config FILE`` / ``python -m services.kvstore``."""

from __future__ import annotations

import logging
import re
import signal
import socket
import threading

from talaria.config import KvStoreConfig, StackConfig

log = logging.getLogger(__name__)


def store_id() -> str:
    """This node's store id (one store per node): the host name as a NATS token."""
    return re.sub(r"[^A-Za-z0-9_\-]", "-", socket.gethostname()) or "kvstore"


def run_kvstore(cfg: KvStoreConfig, stop: threading.Event | None = None, stack: StackConfig | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or ``stop``). Prints ``kvstore listening on HOST:PORT`` when ready.

    With ``stack`` (the whole config) the store also records spans (``talaria.otel`` setup for
    ``talaria-kvstore``: JSONL files under ``telemetry.traces_dir`` or OTLP) and, when a NATS server is
    configured (``NATS_URL`` / ``nats.url``), publishes its stats for the telemetry service."""
    from services.kvstore.server import STATS_PUBLISH_S, KvStoreServer
    from talaria import otel

    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    sid = store_id()
    tel = otel.setup("talaria-kvstore", sid, stack.telemetry, stack.namespace) if stack is not None else otel.disabled("talaria-kvstore", sid)
    server = KvStoreServer(cfg, telemetry=tel, store_id=sid)
    server.start()
    publisher = None
    url = stack.nats_url() if stack is not None else None
    if url:
        from services.kvstore.stats import StatsPublisher
        from talaria.subjects import Subjects

        subject = Subjects(stack.namespace).kvstore_stats(sid)
        publisher = StatsPublisher(url, subject, lambda: server.stats_record().SerializeToString(), STATS_PUBLISH_S, stack.nats, f"kvstore-{sid}").start()
    print(
        f"kvstore pool {cfg.capacity_mb} MiB in {cfg.slab_kb} KiB slabs, eviction {cfg.eviction}, "
        f"data plane mooncake/{cfg.protocol} at {server.mooncake.name}"
        + (f"; stats on {publisher.subject}" if publisher is not None else "; no NATS: stats not published"),
        flush=True,
    )
    print(f"kvstore listening on {server.address}", flush=True)
    try:
        stop.wait()
    finally:
        if publisher is not None:
            publisher.stop()
        server.stop()
        tel.shutdown()
    return 0
