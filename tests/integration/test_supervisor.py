"""A supervisor killed with SIGKILL (no chance to clean up) leaves no orphan service processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.integration.conftest import wait_until

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie awaiting its (dead) parent's reaping by init counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_children_die_with_a_killed_supervisor(models_dir):
    script = textwrap.dedent(
        f"""
        import sys, time
        from talaria.config import parse_config
        from talaria.up import LocalStack
        cfg = parse_config({{
            "namespace": "orphans", "models_dir": {str(models_dir)!r}, "synthesize_models": False,
            "kvstore": {{"enabled": False}}, "telemetry": {{"start": False}}, "router": {{"port": 0}},
            "engines": [{{"id": "e0", "models": ["tiny-llama"], "kv_cache_mb": 16, "torch_threads": 1}}],
        }})
        s = LocalStack(cfg, say=lambda _m: None, quiet=True)
        s.start()
        print(s.nats.proc.pid, *[c.proc.pid for c in s.children.values()], flush=True)
        time.sleep(600)
        """
    )
    sup = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in sup.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)  # nats-server, engine, router
        sup.send_signal(signal.SIGKILL)
        sup.wait(10)
        wait_until(lambda: not any(_alive(p) for p in pids), timeout=30)
    finally:
        if sup.poll() is None:
            sup.kill()
