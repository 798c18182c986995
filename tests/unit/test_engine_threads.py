"""The engine process's OpenMP setup (services/engine/main.py): GOMP_SPINCOUNT from config before torch
loads, and the model built on a thread that exits (its OpenMP pool goes with it)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from services.engine.main import in_own_thread, omp_spin_count

CHECK = """
import os, sys
from services.engine.main import omp_spin_count
omp_spin_count(4321)
print(os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def _run(env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def test_spin_count_is_set_before_torch_loads_and_the_environment_wins():
    assert _run({}) == "4321 False"  # importing services.engine.main does not import torch
    assert _run({"GOMP_SPINCOUNT": "77"}) == "77 False"
    assert _run({"OMP_WAIT_POLICY": "PASSIVE"}) == "None False"


def test_spin_count_after_torch_was_imported_only_warns(monkeypatch, caplog):
    import torch  # noqa: F401 - already loaded in this process

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    omp_spin_count(123)
    assert "GOMP_SPINCOUNT" not in os.environ
    assert "not applied" in caplog.text


def test_in_own_thread_returns_and_raises_and_its_thread_ends():
    seen: list[threading.Thread] = []

    def work(x):
        seen.append(threading.current_thread())
        if x < 0:
            raise ValueError("negative")
        return x * 2

    async def main():
        assert await in_own_thread(work, 21) == 42
        with pytest.raises(ValueError, match="negative"):
            await in_own_thread(work, -1)

    asyncio.run(main())
    assert len(seen) == 2 and all(t is not threading.main_thread() and not t.is_alive() for t in seen)
