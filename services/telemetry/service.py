"""Telemetry process: NATS subscriptions feeding the :class:`Collector`, an HTTP server with ``/metrics``
(Prometheus text), ``/summary`` (JSON), ``/health``, and a tick loop that ends idle sessions.

It only observes: plain subscriptions (no queue groups, no replies), so serving is the same whether it runs
or not. Switch records also become spans (``talaria.switch`` with one child per phase) of this process's
tracer, so a switch shows up in the same tracing backend as the calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST

from services.telemetry.collector import Collector, RecordWriter
from talaria import otel
from talaria.config import StackConfig
from talaria.natsutil import close_connection, connect
from talaria.subjects import Subjects

log = logging.getLogger(__name__)

SERVICE_ID = "telemetry-0"


def switch_spans(tel: otel.Telemetry, d: dict) -> None:
    """One ``talaria.switch`` span per switch record, phases as children laid end to end."""
    if not tel.enabled:
        return
    start = float(d.get("started_unix") or time.time() - d["total_seconds"])
    t0 = otel.unix_ns(start)
    attrs = {
        otel.INSTANCE_ID: str(d.get("instance_id", "")),
        "talaria.switch.from_model": str(d.get("from_model", "")),
        "talaria.switch.to_model": str(d.get("to_model", "")),
        "talaria.switch.path": d["path"],
        "talaria.switch.reason": str(d.get("reason", "")),
    }
    for k in ("weight_bytes", "staged_bytes", "host_bytes", "dirty_bytes"):
        if k in d:
            attrs[f"talaria.switch.{k}"] = int(float(d[k]))
    span = tel.tracer.start_span("talaria.switch", start_time=t0, attributes=attrs)
    ctx = trace.set_span_in_context(span)
    t = t0
    for phase, secs in d["phases"].items():
        dt = otel.unix_ns(secs)
        tel.tracer.start_span(f"talaria.switch.{phase}", context=ctx, start_time=t).end(end_time=t + dt)
        t += dt
    span.end(end_time=t0 + otel.unix_ns(d["total_seconds"]))


def create_app(collector: Collector, tel: otel.Telemetry, nc_ok) -> FastAPI:
    app = FastAPI(title="Talaria telemetry", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        collector.tick()
        return Response(collector.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/summary")
    async def summary() -> JSONResponse:
        collector.tick()
        body = collector.summary()
        body["export"] = {"destination": tel.destination, **tel.stats.as_dict()}
        return JSONResponse(body)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = nc_ok()
        return JSONResponse({"status": "ok" if ok else "degraded"}, status_code=200 if ok else 503)

    return app


async def run_telemetry(cfg: StackConfig, stop: asyncio.Event, ready: asyncio.Future | None = None, records_file: str | None = None) -> None:
    tc = cfg.telemetry
    url = cfg.nats_url()
    if not url:
        raise RuntimeError("telemetry needs a NATS server: set nats.url in the config or NATS_URL")
    subjects = Subjects(cfg.namespace)
    tel = otel.setup("talaria-telemetry", SERVICE_ID, tc, cfg.namespace)
    path = records_file or tc.records_file
    writer = RecordWriter(Path(path).expanduser()) if path else None
    collector = Collector(tc.session_idle_s, writer, tc.record_heartbeats, on_switch=lambda d: switch_spans(tel, d))
    nc = await connect(url, "telemetry", cfg.nats)

    def handler(kind: str):
        async def cb(msg) -> None:
            collector.feed(kind, msg.data)

        return cb

    subs = [
        await nc.subscribe(subjects.all_heartbeats(), cb=handler("heartbeat")),
        await nc.subscribe(subjects.completed(), cb=handler("hook")),
        await nc.subscribe(subjects.all_router_calls(), cb=handler("call")),
        await nc.subscribe(subjects.all_switches(), cb=handler("switch")),
        await nc.subscribe(subjects.all_rounds(), cb=handler("round")),
        await nc.subscribe(subjects.all_kvstore_stats(), cb=handler("kvstore")),
    ]

    async def ticker() -> None:
        while True:
            await asyncio.sleep(min(0.25, tc.session_idle_s / 4))
            try:
                collector.tick()
            except Exception:  # noqa: BLE001
                log.exception("telemetry tick failed")

    tick_task = asyncio.create_task(ticker())
    app = create_app(collector, tel, lambda: nc.is_connected)
    server = uvicorn.Server(uvicorn.Config(app, host=tc.host, port=tc.port, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None
    serve = asyncio.create_task(server.serve())
    while not server.started:
        if serve.done():
            await serve
            raise RuntimeError("telemetry HTTP server stopped during startup")
        await asyncio.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    base = f"http://{host}:{port}"
    print(f"telemetry listening on {base}", flush=True)
    if ready is not None and not ready.done():
        ready.set_result((base, collector))
    try:
        await stop.wait()
    finally:
        server.should_exit = True
        await serve
        tick_task.cancel()
        await close_connection(nc, subs)
        collector.tick(time.time() + tc.session_idle_s)  # end every open session: the run is over
        if writer is not None:
            writer.close()
        await asyncio.to_thread(tel.shutdown)
