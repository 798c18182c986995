"""``talaria up``: the whole local stack in one command.

Starts an embedded NATS server (unless ``NATS_URL``/``nats.url`` names one), synthesizes missing catalog
models, starts every configured engine, the router and the telemetry service (``telemetry.start``) as child
processes, prints the API URL, and on
Ctrl-C / SIGTERM stops every process it started (SIGTERM, then SIGKILL after a grace period; each child
runs in its own process group so nothing is left behind, and gets SIGTERM if this process dies). A child that exits unexpectedly is reported;
if the router dies the stack stops.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from talaria.config import NatsConfig, StackConfig, dump_config
from talaria.natsutil import EmbeddedNats, auth_url, die_with_parent, generate_password


def _say(msg: str) -> None:
    print(f"[talaria] {msg}", flush=True)


class Child:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], ready_marker: str, echo: bool = True):
        self.name = name
        self.echo = echo
        self.log: list[str] = []
        self.ready = threading.Event()
        self.ready_line = ""
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, bufsize=1,
            preexec_fn=die_with_parent,  # a SIGKILLed supervisor leaves no orphans
        )
        self._marker = ready_marker
        threading.Thread(target=self._pump, daemon=True, name=f"log-{name}").start()

    def _pump(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            line = line.rstrip()
            self.log.append(line)
            del self.log[:-500]
            if self.echo:
                print(f"[{self.name}] {line}", flush=True)
            if self._marker in line and not self.ready.is_set():
                self.ready_line = line
                self.ready.set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_ready(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for c in children:
        while not c.ready.wait(0.1):
            if not c.alive():
                tail = "\n  ".join(c.log[-20:])
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during startup; last lines:\n  {tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{c.name} did not become ready within {timeout:.0f}s")


class LocalStack:
    """NATS (embedded unless configured), engines and router as child processes of this one.

    Used by ``talaria up``, by the integration tests and by the benchmarks, so all three run the same
    processes the same way. ``start()`` returns the router's base URL; ``stop()`` stops everything it
    started and is safe to call twice.
    """

    def __init__(self, cfg: StackConfig, say: Callable[[str], None] = _say, quiet: bool = False):
        self.cfg = cfg
        self.say = say
        self.quiet = quiet
        self.nats: EmbeddedNats | None = None
        self.children: dict[str, Child] = {}
        self.api: str | None = None
        self.telemetry_url: str | None = None  # /metrics, /summary of the telemetry service (None: not started)
        self.nats_url: str | None = None  # with the generated credentials in it (in-process clients; never print it)
        self._plain_nats_url: str | None = None
        self.secret_env: dict[str, str] = {}  # per-stack secrets for the children, never on disk
        self._workdir: str | None = None  # private 0700 dir holding stack.json; created on first write
        self.cfg_path: Path | None = None  # the config children read (no secrets: those travel as env)

    def _write_config(self) -> None:
        """Write ``self.cfg`` to ``cfg_path`` (mutates: creates the private work dir on first use).

        The file holds the whole config, NATS credentials included: it is created readable by the owner only
        (0600, in a 0700 ``mkdtemp`` directory) and ``stop()`` removes the directory."""
        if self._workdir is None or not os.path.isdir(self._workdir):
            self._workdir = tempfile.mkdtemp(prefix="talaria-up-")
            self.cfg_path = Path(self._workdir) / "stack.json"
        assert self.cfg_path is not None
        os.close(os.open(self.cfg_path, os.O_WRONLY | os.O_CREAT, 0o600))  # exists with 0600 before any byte is written
        os.chmod(self.cfg_path, 0o600)
        dump_config(self.cfg, self.cfg_path)

    def _remove_workdir(self) -> None:
        """Delete the work dir and the config in it (mutates ``_workdir``/``cfg_path``); safe to call twice."""
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None
        self.cfg_path = None

    def ensure_models(self) -> None:
        cfg = self.cfg
        needed = sorted({m for e in cfg.engines for m in e.models})
        missing = [m for m in needed if not (cfg.model_path(m) / "config.json").exists()]
        from talaria.models.importer import import_known

        missing = import_known(missing, cfg.models_dir, self.say)  # real models from installed packages (smollm2)
        if not missing:
            return
        if not cfg.synthesize_models:
            raise RuntimeError(f"models missing under {cfg.models_dir}: {missing} (synthesize_models is off)")
        from talaria.models.synth import synthesize

        self.say(f"synthesizing models {missing} into {cfg.models_dir} (seed {cfg.synth_seed}) ...")
        t0 = time.monotonic()
        synthesize(Path(cfg.models_dir), seed=cfg.synth_seed, names=missing)
        self.say(f"models ready in {time.monotonic() - t0:.1f}s")

    def _env(self) -> dict[str, str]:
        assert self._plain_nats_url
        return {**os.environ, "NATS_URL": self._plain_nats_url, "PYTHONUNBUFFERED": "1", **self.secret_env}

    def _stack_secrets(self, embedded: bool) -> dict[str, str]:
        """Credentials generated for this stack, handed to the children as ``TALARIA__*``
        environment overrides (never written to stack.json or logged): the embedded NATS user's password,
        the kvstore token engines present, the routers' resume-token key. Configured values are kept."""
        cfg, env = self.cfg, {}
        if embedded:
            env["TALARIA__NATS__USER"] = "talaria"
            env["TALARIA__NATS__PASSWORD"] = generate_password()  # a shape nats-server reads back intact
        if cfg.kvstore.auth_token is None:
            env["TALARIA__KVSTORE__AUTH_TOKEN"] = secrets.token_urlsafe(24)
        if cfg.router.auth.resume_secret is None:
            env["TALARIA__ROUTER__AUTH__RESUME_SECRET"] = secrets.token_urlsafe(32)
        return env

    def start(self, ready_timeout: float = 300.0) -> str:
        self.ensure_models()
        url = self.cfg.nats_url()
        self.secret_env = self._stack_secrets(embedded=not url)
        if not url:
            user, pw = self.secret_env["TALARIA__NATS__USER"], self.secret_env["TALARIA__NATS__PASSWORD"]
            self.nats = EmbeddedNats(self.cfg.nats.host, self.cfg.nats.port, self.cfg.nats.store_dir, user=user, password=pw)
            url = self.nats.start()
            self.say(f"embedded NATS with JetStream at {url} (generated credentials; unauthenticated clients are refused)")
            self.nats_url = auth_url(url, user, pw)
        else:
            self.say(f"using NATS at {url}")
            self.nats_url = url
        self._plain_nats_url = url
        self.cfg = self.cfg.model_copy(update={"nats": NatsConfig(**{**self.cfg.nats.model_dump(), "url": url})})
        telemetry = self._start_telemetry()
        self._write_config()
        self.start_kvstore(ready_timeout)
        for e in self.cfg.engines:

            self.start_engine(e.id, wait=False)
        _wait_ready([self.children[e.id] for e in self.cfg.engines], ready_timeout)
        self.say(f"starting router {self.cfg.router.id}")
        router = self._spawn(self.cfg.router.id, ["-m", "services.router", "--config", str(self.cfg_path)], "listening on")
        _wait_ready([router], ready_timeout)
        self.api = router.ready_line.rsplit(" ", 1)[-1]
        if telemetry is not None:
            try:  # observability is not on the serving path: a telemetry that fails to start is reported, not fatal
                _wait_ready([telemetry], 30.0)
                self.telemetry_url = telemetry.ready_line.rsplit(" ", 1)[-1]
            except RuntimeError as e:
                self.say(f"telemetry not available: {e}")
        return self.api

    def _start_telemetry(self) -> Child | None:
        """Spawn the telemetry service (``telemetry.start``); a busy port falls back to a free one."""
        tc = self.cfg.telemetry
        if not tc.start:
            return None
        if tc.port and not _port_free(tc.host, tc.port):
            self.say(f"telemetry port {tc.port} is busy; using a free one")
            self.cfg = self.cfg.model_copy(update={"telemetry": tc.model_copy(update={"port": 0})})
        self._write_config()
        self.say("starting telemetry")
        return self._spawn("telemetry", ["-m", "services.telemetry", "--config", str(self.cfg_path)], "telemetry listening on")

    KVSTORE = "kvstore"

    def start_kvstore(self, ready_timeout: float = 60.0) -> Child | None:
        """(Re)start the node's kvstore when configured (``kvstore.enabled`` and an engine with ``host_kv``).

        On the first start a port of 0 becomes the one it bound, written into the config engines read, so
        a restart (tests: store killed) comes back on the same address."""
        kvs = self.cfg.kvstore
        if not kvs.enabled or not any(e.host_kv for e in self.cfg.engines):
            return None
        old = self.children.get(self.KVSTORE)
        if old is not None and old.alive():
            raise RuntimeError("kvstore is already running")
        self.say(f"starting kvstore ({kvs.capacity_mb} MiB host pool, mooncake/{kvs.protocol})")
        c = self._spawn(self.KVSTORE, ["-m", "services.kvstore", "--config", str(self.cfg_path)], "kvstore listening on")
        _wait_ready([c], ready_timeout)
        port = int(c.ready_line.rsplit(":", 1)[-1])
        if port != kvs.port:
            self.cfg = self.cfg.model_copy(update={"kvstore": kvs.model_copy(update={"port": port})})
            self._write_config()
        return c

    def _spawn(self, name: str, args: list[str], marker: str) -> Child:

        c = Child(name, [sys.executable, *args], self._env(), marker, echo=not self.quiet)
        self.children[name] = c
        return c

    def start_engine(self, engine_id: str, wait: bool = True, ready_timeout: float = 300.0) -> Child:
        """(Re)start one configured engine as a new process."""
        e = self.cfg.engine(engine_id)
        old = self.children.get(engine_id)
        if old is not None and old.alive():
            raise RuntimeError(f"engine {engine_id} is already running")
        self.say(f"starting engine {e.id} ({e.pool}, models {e.models}, {e.device})")
        c = self._spawn(e.id, ["-m", "services.engine", "--config", str(self.cfg_path), "--id", e.id], "serving")
        if wait:
            _wait_ready([c], ready_timeout)
        return c

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one child's process group (tests: a crashed or stopped engine)."""
        c = self.children[name]
        try:
            os.killpg(c.proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig in (signal.SIGKILL, signal.SIGTERM):
            c.proc.wait(30)

    def stop(self, grace: float = 30.0) -> None:
        children = list(self.children.values())
        for c in reversed(children):
            c.terminate()
        deadline = time.monotonic() + grace
        for c in children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{c.name} did not stop in time; killing it")
            c.kill()  # also reaps anything left in its process group
            if c.proc.poll() is None:
                c.proc.wait(5)
        self.children.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        self._remove_workdir()

    def __enter__(self) -> "LocalStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def up(cfg: StackConfig, port: int | None = None, models_dir: str | None = None, ready_timeout: float = 300.0) -> int:
    updates: dict[str, Any] = {}
    if models_dir:
        updates["models_dir"] = models_dir
    if port is not None:
        updates["router"] = cfg.router.model_copy(update={"port": port})
    stack = LocalStack(cfg.model_copy(update=updates))

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        api = stack.start(ready_timeout)
        models = sorted({m for e in stack.cfg.engines for m in e.models})
        _say(f"ready: OpenAI API at {api}/v1  (models: {', '.join(models)}; Ctrl-C to stop)")
        keys = stack.cfg.router.auth.api_keys
        _say(f"API keys required ({len(keys)} key(s))" if keys else "no API keys configured: the API is open to anyone who can reach it (--api-key KEY)")
        if stack.telemetry_url:
            _say(f"telemetry: {stack.telemetry_url}/metrics (Prometheus), {stack.telemetry_url}/summary (JSON)")
        reported: set[str] = set()
        while not stop.wait(0.5):
            for c in stack.children.values():
                if not c.alive() and c.name not in reported:
                    reported.add(c.name)
                    _say(f"{c.name} exited with code {c.proc.returncode}")
            if not stack.children[stack.cfg.router.id].alive():
                _say("router is gone; stopping the stack")
                return 1
        _say("stopping ...")
        return 0
    except RuntimeError as e:
        _say(f"error: {e}")
        return 1
    finally:
        stack.stop()
        _say("stopped")
