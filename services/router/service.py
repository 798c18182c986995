"""Router process: NATS subscriptions (heartbeats, completion hooks) feeding the registry and the session
table, and the HTTP server. ``run_router`` returns when ``stop`` is set (SIGTERM/SIGINT in ``__main__``),
after the HTTP server has stopped accepting and in-flight responses have finished (graceful drain).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

import uvicorn
from nats.aio.client import Client as NATS

from services.router.app import create_app
from services.router.registry import Registry
from services.router.sessions import SessionTable
from talaria.clock import MonotonicClock
from talaria.config import StackConfig
from talaria.natsutil import connect
from talaria.subjects import Subjects
from talaria.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class RouterState:
    cfg: StackConfig
    subjects: Subjects
    registry: Registry
    sessions: SessionTable
    nc: NATS | None = None
    counters: Counter = field(default_factory=Counter)

    def on_heartbeat(self, data: bytes) -> None:
        snap = pb.InstanceSnapshot()
        try:
            snap.ParseFromString(data)
        except Exception:  # noqa: BLE001 - one bad message must not stop the subscription
            self.counters["bad_heartbeat"] += 1
            return
        prev = self.registry.instances.get(snap.instance_id)
        if prev is not None and snap.epoch > prev.snapshot.epoch:
            # The engine restarted: the KV the table points at is gone.
            self.sessions.forget_instance(snap.instance_id)
        self.registry.observe(snap)

    def on_completed(self, data: bytes) -> None:
        hook = pb.CompletionHook()
        try:
            hook.ParseFromString(data)
        except Exception:  # noqa: BLE001
            self.counters["bad_hook"] += 1
            return
        self.counters["hooks"] += 1
        if hook.session_id and not hook.HasField("error"):
            self.sessions.record(hook.session_id, hook.model, hook.instance_id, hook.prefix.committed_tokens)


def make_state(cfg: StackConfig) -> RouterState:
    clock = MonotonicClock()
    return RouterState(
        cfg=cfg,
        subjects=Subjects(cfg.namespace),
        registry=Registry(clock, miss_limit=cfg.router.heartbeat_miss_limit),
        sessions=SessionTable(clock),
    )


async def run_router(cfg: StackConfig, stop: asyncio.Event, ready: asyncio.Future | None = None) -> None:
    url = cfg.nats_url()
    if not url:
        raise RuntimeError("router needs a NATS server: set nats.url in the config or NATS_URL")
    state = make_state(cfg)
    state.nc = await connect(url, f"router-{cfg.router.id}", cfg.nats)
    async def on_heartbeat(msg) -> None:
        state.on_heartbeat(msg.data)

    async def on_completed(msg) -> None:
        state.on_completed(msg.data)

    subs = [
        await state.nc.subscribe(state.subjects.all_heartbeats(), cb=on_heartbeat),
        await state.nc.subscribe(state.subjects.completed(), cb=on_completed),
    ]
    app = create_app(state)
    server = uvicorn.Server(
        uvicorn.Config(app, host=cfg.router.host, port=cfg.router.port, log_level="warning", lifespan="off", timeout_graceful_shutdown=30)
    )
    server.install_signal_handlers = lambda: None  # the process owner handles signals
    serve = asyncio.create_task(server.serve())
    while not server.started:
        if serve.done():
            await serve  # propagate the bind error
            raise RuntimeError("router HTTP server stopped during startup")
        await asyncio.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    api = f"http://{host}:{port}"
    log.info("router %s listening on %s", cfg.router.id, api)
    print(f"router {cfg.router.id} listening on {api}", flush=True)
    if ready is not None and not ready.done():
        ready.set_result((api, state))
    try:
        await stop.wait()
    finally:
        server.should_exit = True
        await serve
        for s in subs:
            await s.unsubscribe()
        await state.nc.drain()

