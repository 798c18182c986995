"""``talaria health``: one-shot health probes usable as Docker ``HEALTHCHECK`` / Nomad ``script`` checks.

Engines have no HTTP port: their liveness *is* their heartbeat on NATS (Talaria §4.1 — an instance that
misses heartbeats is excluded by every router). So the engine probe asks the same question a router asks:
did a fresh ``InstanceSnapshot`` of this instance arrive within the window? It subscribes to
``<ns>.engine.<id>.heartbeat`` with the configured NATS credentials/TLS and waits at most ``timeout``
seconds. A draining instance counts as unhealthy unless ``allow_draining`` is set.

Other probes, for images that carry no curl: ``--http URL`` (2xx => healthy; the router's ``/health`` and
``/ready``, telemetry's ``/metrics``), ``--grpc HOST:PORT`` (the standard gRPC health service, as the
kvstore serves it) and ``--tcp HOST:PORT`` (a plain TCP connect).

Exit status: 0 healthy, 1 unhealthy, 2 usage/config error. One JSON line on stdout says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from talaria.config import StackConfig
from talaria.subjects import Subjects, check_token

if TYPE_CHECKING:
    from nats.aio.msg import Msg


async def engine_heartbeat(cfg: StackConfig, engine_id: str, url: str, timeout: float, allow_draining: bool = False) -> tuple[bool, dict[str, Any]]:
    """Wait up to ``timeout`` s for one heartbeat of ``engine_id``; returns (healthy, details)."""
    from talaria.natsutil import connect
    from talaria.v1 import engine_pb2 as pb

    subject = Subjects(cfg.namespace).heartbeat(engine_id)
    ncfg = cfg.nats.model_copy(update={"max_reconnect_attempts": 0, "connect_timeout_s": min(cfg.nats.connect_timeout_s, timeout)})
    t0 = time.monotonic()
    try:
        nc = await asyncio.wait_for(connect(url, f"health-{engine_id}", ncfg), timeout)
    except Exception as e:  # noqa: BLE001 - any failure to reach NATS is "unhealthy", with the reason
        return False, {"engine": engine_id, "error": f"cannot connect to NATS at {url}: {type(e).__name__}: {e}"}
    try:
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_msg(msg: Msg) -> None:
            if not got.done():
                got.set_result(msg.data)

        await nc.subscribe(subject, cb=on_msg)
        left = max(0.05, timeout - (time.monotonic() - t0))
        try:
            data = await asyncio.wait_for(got, left)
        except asyncio.TimeoutError:
            return False, {"engine": engine_id, "error": f"no heartbeat on {subject} within {timeout:g}s"}
        snap = pb.InstanceSnapshot()
        snap.ParseFromString(data)
        info = {
            "engine": engine_id,
            "epoch": snap.epoch,
            "seq": snap.seq,
            "draining": snap.draining,
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "models": [m.model for m in snap.models if m.loaded],
            "kernels": {k.name: k.state for k in snap.kernels},  # which kernels the engine runs
            "waited_s": round(time.monotonic() - t0, 3),
        }
        if snap.draining and not allow_draining:
            info["error"] = "instance is draining"
            return False, info
        return True, info
    finally:
        try:
            await nc.close()
        except Exception:  # noqa: BLE001 - closing a half-open connection
            pass


def http_ok(url: str, timeout: float) -> tuple[bool, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - operator-given URL
            return 200 <= r.status < 300, {"url": url, "status": r.status}
    except urllib.error.HTTPError as e:
        return False, {"url": url, "status": e.code}
    except (OSError, ValueError) as e:
        return False, {"url": url, "error": str(e)}


def tcp_ok(addr: str, timeout: float) -> tuple[bool, dict[str, Any]]:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout):
            return True, {"tcp": addr}
    except (OSError, ValueError) as e:
        return False, {"tcp": addr, "error": str(e)}


def grpc_ok(addr: str, timeout: float, service: str = "") -> tuple[bool, dict[str, Any]]:
    """Standard ``grpc.health.v1.Health/Check`` (the kvstore serves it) without generated stubs.

    HealthCheckRequest is ``{1: service}``; HealthCheckResponse is ``{1: status}`` with SERVING = 1.
    """
    import grpc

    req = service.encode()
    req = (b"\x0a" + bytes([len(req)]) + req) if req else b""
    try:
        with grpc.insecure_channel(addr) as ch:
            check: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary("/grpc.health.v1.Health/Check")
            resp = check(req, timeout=timeout)
    except grpc.RpcError as e:
        return False, {"grpc": addr, "error": f"{e.code().name}: {e.details()}"}
    status = resp[1] if len(resp) >= 2 and resp[0] == 0x08 else 0
    names = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
    return status == 1, {"grpc": addr, "status": names.get(status, str(status))}


def add_cli(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    h = sub.add_parser("health", help="one-shot health probe (exit 0 healthy, 1 unhealthy): engine heartbeat, HTTP or TCP")
    h.add_argument("--config", help="stack config (namespace, NATS URL and credentials); NATS_URL overrides")
    g = h.add_mutually_exclusive_group(required=True)
    g.add_argument("--engine", metavar="ID", help="healthy if a heartbeat of this engine arrives within --timeout")
    g.add_argument("--http", metavar="URL", help="healthy if GET URL answers 2xx")
    g.add_argument("--tcp", metavar="HOST:PORT", help="healthy if a TCP connection opens")
    g.add_argument("--grpc", metavar="HOST:PORT", help="healthy if grpc.health.v1.Health/Check answers SERVING (kvstore)")
    h.add_argument("--timeout", type=float, default=None, help="seconds to wait (default: 3 heartbeat periods, at least 2 s)")
    h.add_argument("--allow-draining", action="store_true", help="a draining engine still counts as healthy")
    h.set_defaults(fn=cmd_health)


def cmd_health(args: argparse.Namespace) -> int:
    from talaria.config import ConfigError, load_config

    if args.http:
        ok, info = http_ok(args.http, args.timeout or 3.0)
    elif args.tcp:
        ok, info = tcp_ok(args.tcp, args.timeout or 3.0)
    elif args.grpc:
        ok, info = grpc_ok(args.grpc, args.timeout or 3.0)
    else:
        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            print(json.dumps({"healthy": False, "error": str(e)}))
            return 2
        try:
            check_token(args.engine, "engine id")
        except ValueError as e:
            print(json.dumps({"healthy": False, "error": str(e)}))
            return 2
        url = cfg.nats_url()
        if not url:
            print(json.dumps({"healthy": False, "error": "no NATS server: set nats.url in the config or NATS_URL"}))
            return 2
        timeout = args.timeout
        if timeout is None:
            period = next((e.heartbeat_period_s for e in cfg.engines if e.id == args.engine), 0.5)
            timeout = max(2.0, 3 * period)
        ok, info = asyncio.run(engine_heartbeat(cfg, args.engine, url, timeout, args.allow_draining))
    print(json.dumps({"healthy": ok, **info}), flush=True)
    return 0 if ok else 1
