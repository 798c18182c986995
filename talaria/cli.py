"""The ``talaria`` command: ``up``, ``router``, ``engine``, ``telemetry``, ``models``, ``health``, ``proto``, ``bench``, ``sim``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _load(args):
    from talaria.config import ConfigError, load_config

    try:
        return load_config(args.config)
    except ConfigError as e:
        print(f"talaria: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _run_until_signal(coro_factory) -> int:
    """Run ``coro_factory(stop_event)`` until SIGINT/SIGTERM sets the event."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await coro_factory(stop)

    asyncio.run(main())
    return 0


def _with_api_key(cfg, key: str | None):
    """Add one API key (tenant "default", all models) for ``--api-key``; only its hash enters the config."""
    if not key:
        return cfg
    from services.router.auth import key_hash
    from talaria.config import ApiKeyConfig

    auth = cfg.router.auth
    keys = [*auth.api_keys, ApiKeyConfig(sha256=key_hash(key), tenant="default")]
    router = cfg.router.model_copy(update={"auth": auth.model_copy(update={"api_keys": keys})})
    return cfg.model_copy(update={"router": router})


def cmd_router(args) -> int:
    from talaria.config import RouterConfig

    cfg = _with_api_key(_load(args), args.api_key)
    if args.port is not None or args.host is not None:
        r = cfg.router.model_dump()
        r.update({k: v for k, v in (("port", args.port), ("host", args.host)) if v is not None})
        cfg = cfg.model_copy(update={"router": RouterConfig(**r)})
    from services.router.service import run_router

    return _run_until_signal(lambda stop: run_router(cfg, stop))


def cmd_engine(args) -> int:
    cfg = _load(args)
    try:
        ecfg = cfg.engine(args.id)
    except KeyError as e:
        print(f"talaria: {e.args[0]}", file=sys.stderr)
        return 2
    url = cfg.nats_url()
    if not url:
        print("talaria: engine needs a NATS server: set nats.url in the config or NATS_URL", file=sys.stderr)
        return 2
    from services.engine.main import run_engine

    return _run_until_signal(lambda stop: run_engine(cfg, ecfg, url, stop))


def cmd_kvstore(args) -> int:
    stack = _load(args)
    cfg = stack.kvstore
    over = {k: v for k, v in (("host", args.host), ("port", args.port), ("capacity_mb", args.capacity_mb)) if v is not None}
    if over:
        cfg = cfg.model_copy(update=over)
    from services.kvstore.main import run_kvstore

    return run_kvstore(cfg, stack=stack)


def cmd_telemetry(args) -> int:
    from talaria.config import TelemetryConfig

    cfg = _load(args)
    over = {k: v for k, v in (("host", args.host), ("port", args.port), ("records_file", args.records)) if v is not None}
    if over:
        cfg = cfg.model_copy(update={"telemetry": TelemetryConfig(**{**cfg.telemetry.model_dump(), **over})})
    if not cfg.nats_url():
        print("talaria: telemetry needs a NATS server: set nats.url in the config or NATS_URL", file=sys.stderr)
        return 2
    from services.telemetry.service import run_telemetry

    return _run_until_signal(lambda stop: run_telemetry(cfg, stop))


def cmd_up(args) -> int:

    from talaria.up import up

    cfg = _with_api_key(_load(args), args.api_key)
    return up(cfg, port=args.port, models_dir=args.models_dir)


def cmd_serve(args) -> int:
    """One checkpoint directory, served alone: one hot engine and the router (``talaria up`` underneath)."""
    from pathlib import Path

    from talaria.config import EngineConfig
    from talaria.up import up

    path = Path(args.path).expanduser().resolve()
    if not (path / "config.json").exists():
        print(f"talaria serve: {path} is not a checkpoint directory (no config.json); import one with 'talaria models import SRC'", file=sys.stderr)
        return 2
    cfg = _load(args)
    cfg = cfg.model_copy(update={"models_dir": str(path.parent), "synthesize_models": False, "engines": [EngineConfig(id="engine-0", models=[path.name])]})
    return up(cfg, port=args.port)


def cmd_proto(args) -> int:
    from talaria.protogen import generate

    return generate(check=args.check)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="talaria", description="Session-aware multi-model LLM serving for tool-using agents")
    p.add_argument("--log-level", default=os.environ.get("TALARIA_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start the whole local stack (embedded NATS, engines, router)")
    up.add_argument("--config", help="YAML/TOML/JSON stack config (default: embedded defaults)")
    up.add_argument("--port", type=int, help="router HTTP port (overrides the config)")
    up.add_argument("--models-dir", help="where catalog models live / are synthesized")
    up.add_argument("--api-key", default=os.environ.get("TALARIA_API_KEY"), help="require this API key (Bearer) for tenant 'default'; default $TALARIA_API_KEY; none = open API")
    up.set_defaults(fn=cmd_up)

    sv = sub.add_parser("serve", help="serve one checkpoint directory (one hot engine + router)")
    sv.add_argument("path", help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    sv.add_argument("--config", help="stack config for everything but the engines")
    sv.add_argument("--port", type=int, help="router HTTP port (overrides the config)")
    sv.set_defaults(fn=cmd_serve)

    r = sub.add_parser("router", help="run one router process")
    r.add_argument("--config")
    r.add_argument("--host")
    r.add_argument("--port", type=int)
    r.add_argument("--api-key", default=os.environ.get("TALARIA_API_KEY"), help="require this API key (Bearer) for tenant 'default'; default $TALARIA_API_KEY; none = open API")
    r.set_defaults(fn=cmd_router)

    e = sub.add_parser("engine", help="run one engine worker process")
    e.add_argument("--config")
    e.add_argument("--id", required=True, help="engine id from the config")
    e.set_defaults(fn=cmd_engine)

    kv = sub.add_parser("kvstore", help="run the node's host KV store (gRPC control, Mooncake data plane)")
    kv.add_argument("--config")
    kv.add_argument("--host")
    kv.add_argument("--port", type=int)
    kv.add_argument("--capacity-mb", type=int)
    kv.set_defaults(fn=cmd_kvstore)


    t = sub.add_parser("telemetry", help="run the telemetry service (/metrics, /summary, SCT, records file)")
    t.add_argument("--config")
    t.add_argument("--host")
    t.add_argument("--port", type=int)
    t.add_argument("--records", help="append every record to this JSONL file (bench/report input)")
    t.set_defaults(fn=cmd_telemetry)

    pr = sub.add_parser("proto", help="wire contracts")
    prs = pr.add_subparsers(dest="proto_cmd", required=True)
    g = prs.add_parser("gen", help="regenerate talaria/v1 from proto/")
    g.add_argument("--check", action="store_true", help="fail if the generated code is out of date")
    g.set_defaults(fn=cmd_proto)

    from talaria.models.cli import add_cli as add_models_cli

    add_models_cli(sub)
    from talaria.health import add_cli as add_health_cli

    add_health_cli(sub)
    try:
        from bench.cli import add_cli as add_bench_cli
    except ImportError:
        add_bench_cli = None
    if add_bench_cli is not None:
        add_bench_cli(sub)
    try:  # the simulator is a top-level package above talaria/ (it drives services' policies)
        from sim.cli import add_cli as add_sim_cli
    except ImportError:
        add_sim_cli = None
    if add_sim_cli is not None:
        add_sim_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
