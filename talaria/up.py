"""``talaria up``: the whole local stack in one command.

Starts an embedded NATS server (unless ``NATS_URL``/``nats.url`` names one), synthesizes missing catalog
models, starts every configured engine and the router as child processes, prints the API URL, and on
Ctrl-C / SIGTERM stops every process it started (SIGTERM, then SIGKILL after a grace period; each child
runs in its own process group so nothing is left behind). A child that exits unexpectedly is reported;
if the router dies the stack stops.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from talaria.config import NatsConfig, StackConfig, dump_config
from talaria.natsutil import EmbeddedNats


def _say(msg: str) -> None:
    print(f"[talaria] {msg}", flush=True)


class Child:
    def __init__(self, name: str, cmd: list[str], env: dict, ready_marker: str):
        self.name = name
        self.ready = threading.Event()
        self.ready_line = ""
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, bufsize=1)
        self._marker = ready_marker
        threading.Thread(target=self._pump, daemon=True, name=f"log-{name}").start()

    def _pump(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            line = line.rstrip()
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
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode} during startup (see its log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{c.name} did not become ready within {timeout:.0f}s")


def up(cfg: StackConfig, port: int | None = None, models_dir: str | None = None, ready_timeout: float = 300.0) -> int:
    updates: dict = {}
    if models_dir:
        updates["models_dir"] = models_dir
    if port is not None:
        updates["router"] = cfg.router.model_copy(update={"port": port})
    cfg = cfg.model_copy(update=updates)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    needed = sorted({m for e in cfg.engines for m in e.models})
    missing = [m for m in needed if not (cfg.model_path(m) / "config.json").exists()]
    if missing:
        if not cfg.synthesize_models:
            _say(f"models missing under {cfg.models_dir}: {missing} (synthesize_models is off)")
            return 2
        from talaria.models.synth import synthesize

        _say(f"synthesizing models {missing} into {cfg.models_dir} (seed {cfg.synth_seed}) ...")
        t0 = time.monotonic()
        synthesize(Path(cfg.models_dir), seed=cfg.synth_seed, names=missing)
        _say(f"models ready in {time.monotonic() - t0:.1f}s")

    nats_server: EmbeddedNats | None = None
    children: list[Child] = []
    workdir = tempfile.mkdtemp(prefix="talaria-up-")
    try:
        url = cfg.nats_url()
        if not url:
            nats_server = EmbeddedNats(cfg.nats.host, cfg.nats.port, cfg.nats.store_dir)
            url = nats_server.start()
            _say(f"embedded NATS with JetStream at {url}")
        else:
            _say(f"using NATS at {url}")
        cfg = cfg.model_copy(update={"nats": NatsConfig(**{**cfg.nats.model_dump(), "url": url})})
        cfg_path = Path(workdir) / "stack.json"
        dump_config(cfg, cfg_path)
        env = {**os.environ, "NATS_URL": url, "PYTHONUNBUFFERED": "1"}

        for e in cfg.engines:
            _say(f"starting engine {e.id} ({e.pool}, models {e.models}, {e.device})")
            children.append(Child(e.id, [sys.executable, "-m", "services.engine", "--config", str(cfg_path), "--id", e.id], env, "serving"))
        _wait_ready(children, ready_timeout)
        _say(f"starting router {cfg.router.id}")
        router = Child(cfg.router.id, [sys.executable, "-m", "services.router", "--config", str(cfg_path)], env, "listening on")
        children.append(router)
        _wait_ready([router], ready_timeout)
        api = router.ready_line.rsplit(" ", 1)[-1]
        _say(f"ready: OpenAI API at {api}/v1  (models: {', '.join(needed)}; Ctrl-C to stop)")

        reported: set[str] = set()
        while not stop.wait(0.5):
            for c in children:
                if not c.alive() and c.name not in reported:
                    reported.add(c.name)
                    _say(f"{c.name} exited with code {c.proc.returncode}")
            if not router.alive():
                _say("router is gone; stopping the stack")
                return 1
        _say("stopping ...")
        return 0
    except RuntimeError as e:
        _say(f"error: {e}")
        return 1
    finally:
        for c in reversed(children):
            c.terminate()
        deadline = time.monotonic() + 30
        for c in children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _say(f"{c.name} did not stop in time; killing it")
            c.kill()  # also reaps anything left in its process group
        if nats_server is not None:
            nats_server.stop()
        _say("stopped")
