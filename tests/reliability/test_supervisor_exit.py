"""``talaria up`` stopped with SIGTERM under a call leaves no ``stack.json`` behind, and while it runs the
file (the whole config, NATS credentials included) is readable by its owner only (issue 18 item 12)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading

import httpx
import pytest

from tests.reliability.conftest import MODEL, Figures

pytestmark = pytest.mark.slow


def test_sigterm_under_load_removes_the_private_config(rel_models_dir, tmp_path):
    cfg = {
        "namespace": "upexit", "models_dir": str(rel_models_dir), "synthesize_models": False,
        "kvstore": {"enabled": False}, "telemetry": {"start": False}, "router": {"port": 0},
        "engines": [{"id": "u0", "models": [MODEL], "kv_cache_mb": 16, "torch_threads": 1, "heartbeat_period_s": 0.2}],
    }
    (tmp_path / "up.json").write_text(json.dumps(cfg))
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    up = subprocess.Popen([sys.executable, "-m", "talaria.cli", "up", "--config", str(tmp_path / "up.json")], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    figs = Figures()
    try:
        api = None
        for line in up.stdout:
            if "ready: OpenAI API at " in line:
                api = line.split("ready: OpenAI API at ", 1)[1].split()[0].removesuffix("/v1")
                break
        assert api, "talaria up did not become ready"
        dirs = [p for p in tmpdir.iterdir() if p.name.startswith("talaria-up-")]
        assert len(dirs) == 1 and (dirs[0] / "stack.json").exists()
        assert stat.S_IMODE((dirs[0] / "stack.json").stat().st_mode) == 0o600
        assert stat.S_IMODE(dirs[0].stat().st_mode) == 0o700
        done = threading.Event()

        def call():
            try:
                r = httpx.post(f"{api}/v1/completions", json={"model": MODEL, "prompt": "bye", "max_tokens": 64}, timeout=60)
                figs.add(r.status_code, r.text)
            except httpx.HTTPError:
                figs.add(None)
            done.set()

        t = threading.Thread(target=call)
        t.start()
        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0
        t.join(60)
        left = [p for p in tmpdir.iterdir() if p.name.startswith("talaria-up-")]
        assert left == [], f"left behind: {left}; call during shutdown: {figs}"
        assert figs.s5xx == 0, str(figs)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
