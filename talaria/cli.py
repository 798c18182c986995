"""The ``talaria`` command: ``up``, ``router``, ``engine``, ``telemetry``, ``models``, ``health``, ``proto``, ``bench``, ``sim``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from talaria.config import StackConfig


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _log_level(value: str) -> str:
    """argparse type: one of LOG_LEVELS (any case); anything else is a usage error (exit 2)."""
    if value.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid log level {value!r} (choose from {', '.join(LOG_LEVELS)})")
    return value.lower()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (unix s), level, logger, message (+ exc when there is a traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        import json

        out = {"time": round(record.created, 6), "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def _setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger (mutates logging's global state: level and one stderr handler)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


def _load(args: argparse.Namespace) -> StackConfig:
    from talaria.config import ConfigError, load_config

    try:
        return load_config(args.config)
    except ConfigError as e:
        print(f"talaria: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _run_until_signal(coro_factory: Callable[[asyncio.Event], Awaitable[None]],
                      loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> int:
    """Run ``coro_factory(stop_event)`` until SIGINT/SIGTERM sets the event, on a loop from ``loop_factory``
    (None: asyncio's default)."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await coro_factory(stop)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
    return 0


def event_loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory of a process's ``event_loop`` setting: uvloop's, or None (asyncio's default loop)."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def _with_api_key(cfg: StackConfig, key: str | None) -> StackConfig:
    """Add one API key (tenant "default", all models) for ``--api-key``; only its hash enters the config."""
    if not key:
        return cfg
    from services.router.auth import key_hash
    from talaria.config import ApiKeyConfig

    auth = cfg.router.auth
    keys = [*auth.api_keys, ApiKeyConfig(sha256=key_hash(key), tenant="default")]
    router = cfg.router.model_copy(update={"auth": auth.model_copy(update={"api_keys": keys})})
    return cfg.model_copy(update={"router": router})


def cmd_router(args: argparse.Namespace) -> int:
    from talaria.config import RouterConfig

    cfg = _with_api_key(_load(args), args.api_key)
    if not cfg.router.auth.api_keys and cfg.router.auth.require_keys:
        if not args.open_api:
            print("talaria router: no API key and router.auth.require_keys is set: give --api-key / $TALARIA_API_KEY "
                  "(or router.auth.api_keys), or --open-api / TALARIA_OPEN_API=true to serve anyone who can reach it",
                  file=sys.stderr)
            return 2
        logging.getLogger("talaria.cli").warning("--open-api: the router serves without API keys (router.auth.require_keys overridden)")
    if args.port is not None or args.host is not None:
        r = cfg.router.model_dump()
        r.update({k: v for k, v in (("port", args.port), ("host", args.host)) if v is not None})
        cfg = cfg.model_copy(update={"router": RouterConfig(**r)})
    from services.router.service import run_router

    return _run_until_signal(lambda stop: run_router(cfg, stop), event_loop_factory(cfg.router.event_loop))


def cmd_engine(args: argparse.Namespace) -> int:
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


def cmd_kvstore(args: argparse.Namespace) -> int:
    stack = _load(args)
    cfg = stack.kvstore
    over = {k: v for k, v in (("host", args.host), ("port", args.port), ("capacity_mb", args.capacity_mb)) if v is not None}
    if over:
        cfg = cfg.model_copy(update=over)
    from services.kvstore.main import run_kvstore

    return run_kvstore(cfg, stack=stack)


def cmd_telemetry(args: argparse.Namespace) -> int:
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


def cmd_up(args: argparse.Namespace) -> int:

    from talaria.up import up

    cfg = _with_api_key(_load(args), args.api_key)
    return up(cfg, port=args.port, models_dir=args.models_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    """One checkpoint directory, served alone: one hot engine and the router (``talaria up`` underneath)."""
    from pathlib import Path

    from talaria.config import EngineConfig
    from talaria.up import up

    path = Path(args.path).expanduser().resolve()
    if not (path / "config.json").exists():
        print(f"talaria serve: {path} is not a checkpoint directory (no config.json); import one with 'talaria models import SRC'", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    cfg = _with_api_key(_load(args), args.api_key)
    models_dir, name = path.parent, path.name
    if args.served_model_name and args.served_model_name != path.name:
        # the catalog name is the directory's name: serve the checkpoint through a link with the chosen name
        from talaria.subjects import check_token

        try:
            name = check_token(args.served_model_name, "served model name")
        except ValueError as e:
            print(f"talaria serve: {e}", file=sys.stderr)
            return 2
        models_dir = Path(".talaria") / "served"
        models_dir.mkdir(parents=True, exist_ok=True)
        link = models_dir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(path, target_is_directory=True)
    try:
        engine = EngineConfig(id="engine-0", models=[name], device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    except ValidationError as e:
        print(f"talaria serve: {e}", file=sys.stderr)
        return 2
    updates: dict[str, Any] = {"models_dir": str(models_dir.resolve()), "synthesize_models": False, "engines": [engine]}
    if args.host:
        updates["router"] = cfg.router.model_copy(update={"host": args.host})
    cfg = cfg.model_copy(update=updates)
    return up(cfg, port=args.port)


def cmd_kernels(args: argparse.Namespace) -> int:
    """Build the C++ CPU kernels ahead of time: into torch's extension cache for this CPU (what an engine's
    first start would build), or with ``--out`` a prebuilt directory for ``--march`` (the image does both:
    the baseline and the building CPU's ``native``; engines find it through $TALARIA_KERNELS_DIR)."""
    import time

    from services.engine.model import paged_attn

    t0 = time.monotonic()
    if args.out:
        print(f"building the CPU kernels for -march={args.march} into {args.out} ...", flush=True)
        so = paged_attn.build_prebuilt(Path(args.out), args.march)
        print(f"CPU kernels ready in {time.monotonic() - t0:.0f}s: {so}", flush=True)
        return 0
    if args.march != "native":
        print("talaria kernels build: --march other than native needs --out (the cache serves this CPU only)", file=sys.stderr)
        return 2
    print("building the CPU kernels for this CPU (-march=native; ~1-2 min on 2 cores, once per CPU and version) ...", flush=True)
    module = paged_attn.load_extension()
    if module is None:
        print(f"CPU kernels unavailable: {paged_attn.build_error()} (engines run the portable paths)", file=sys.stderr)
        return 1
    print(f"CPU kernels ready ({paged_attn.variant()}) in {time.monotonic() - t0:.0f}s", flush=True)
    return 0


def cmd_proto(args: argparse.Namespace) -> int:
    from talaria.protogen import generate

    return generate(check=args.check)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="talaria", description="Session-aware multi-model LLM serving for tool-using agents")
    from talaria import __version__

    p.add_argument("--version", action="version", version=f"talaria {__version__}")
    p.add_argument("--log-level", type=_log_level, default=os.environ.get("TALARIA_LOG_LEVEL", "info"),
                   help=f"{' | '.join(LOG_LEVELS)} (default $TALARIA_LOG_LEVEL or info; anything else is an error)")
    p.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("TALARIA_LOG_FORMAT", "text"),
                   help="text, or json: one JSON object per line (default $TALARIA_LOG_FORMAT or text)")
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
    sv.add_argument("--host", help="router bind address (overrides the config; default 127.0.0.1)")
    sv.add_argument("--port", type=int, help="router HTTP port (overrides the config)")
    sv.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto", help="weights and KV dtype (default auto)")
    sv.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    sv.add_argument("--served-model-name", help="the model name clients send (default: the directory's name)")
    sv.add_argument("--max-model-len", type=int, help="longest context (prompt + output tokens) a call may use")
    sv.add_argument("--api-key", default=os.environ.get("TALARIA_API_KEY"), help="require this API key (Bearer) for tenant 'default'; default $TALARIA_API_KEY; none = open API")
    sv.set_defaults(fn=cmd_serve)

    r = sub.add_parser("router", help="run one router process")
    r.add_argument("--config")
    r.add_argument("--host")
    r.add_argument("--port", type=int)
    r.add_argument("--api-key", default=os.environ.get("TALARIA_API_KEY"), help="require this API key (Bearer) for tenant 'default'; default $TALARIA_API_KEY; none = open API")
    r.add_argument("--open-api", action="store_true", default=os.environ.get("TALARIA_OPEN_API", "").lower() in ("1", "true", "yes"),
                   help="serve without API keys even where router.auth.require_keys is set (logged as a warning); default $TALARIA_OPEN_API")
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

    kn = sub.add_parser("kernels", help="the C++ CPU kernels (built ahead of time so no engine compiles at start)")
    kns = kn.add_subparsers(dest="kernels_cmd", required=True)
    kb = kns.add_parser("build", help="compile them now, with a progress line")
    kb.add_argument("--march", default="native", help="native (this CPU; default) or a -march value such as x86-64-v3 (needs --out)")
    kb.add_argument("--out", help="write a prebuilt build here (engines load it via $TALARIA_KERNELS_DIR) instead of torch's cache")
    kb.set_defaults(fn=cmd_kernels)

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
        pass
    else:
        add_bench_cli(sub)
    try:  # the simulator is a top-level package above talaria/ (it drives services' policies)
        from sim.cli import add_cli as add_sim_cli
    except ImportError:
        pass
    else:
        add_sim_cli(sub)
    return p


def _one_line_errors() -> tuple[type[BaseException], ...]:
    """Errors a command reports as one line on stderr (exit 2), not a traceback: a missing public trace file
    (``bench/workloads/traces.py``; its message names the file, its source and how to point at it)."""
    try:
        from bench.workloads.traces import TraceNotFound
    except ImportError:
        return ()
    return (TraceNotFound,)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level, args.log_format)
    try:
        return int(args.fn(args) or 0)
    except _one_line_errors() as e:
        print(f"talaria: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
