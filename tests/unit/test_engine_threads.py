"""The engine process's OpenMP setup (services/engine/main.py): GOMP_SPINCOUNT from config before torch
loads, and the model built on a thread that exits (its OpenMP pool goes with it)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from services.engine.main import OWNED_SPIN, SHARED_SPIN, in_own_thread, omp_spin_count, spin_count_for
from talaria.config import EngineConfig, StackConfig

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


def test_auto_spin_is_fast_only_for_a_stacks_only_cpu_engine():
    """``omp_spin_count: auto`` (the default): the libgomp spin for the stack's only CPU engine, the robust
    one when several CPU engines share the host; an explicit count always wins."""
    one = StackConfig(engines=[EngineConfig(id="a", models=["m"])])
    assert spin_count_for(one, one.engines[0]) == OWNED_SPIN == 300_000
    gpu_too = StackConfig(engines=[EngineConfig(id="a", models=["m"]), EngineConfig(id="g", models=["m"], device="cuda:0")])
    assert spin_count_for(gpu_too, gpu_too.engines[0]) == OWNED_SPIN
    default = StackConfig()  # the embedded stack: a hot and a cold CPU engine
    assert [spin_count_for(default, e) for e in default.engines] == [SHARED_SPIN] * 2 == [1000] * 2
    pinned = StackConfig(engines=[EngineConfig(id="a", models=["m"], omp_spin_count=30_000), EngineConfig(id="b", models=["m"])])
    assert spin_count_for(pinned, pinned.engines[0]) == 30_000
    with pytest.raises(ValueError):
        EngineConfig(id="a", models=["m"], omp_spin_count=-1)
    with pytest.raises(ValueError):
        EngineConfig(id="a", models=["m"], omp_spin_count="fast")


def test_spin_count_after_torch_was_imported_only_warns(monkeypatch, caplog):
    import torch  # noqa: F401 - already loaded in this process

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    caplog.set_level("WARNING", logger="services.engine.main")  # whatever level an earlier in-process CLI run left on the root
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


def test_a_worker_setting_one_thread_does_not_shrink_the_executors_team(synth_models):
    """Issue 42: ``torch.set_num_threads`` on one thread is also the default of every thread that never set its
    own. The host KV tier's workers set 1 for themselves; the executor thread, started after them, then ran
    every step with one thread (the default stack's decode at 0.69x of the stack without the tier). The engine
    gives its stepping thread its own count (``intra_op_threads``), whatever other threads set."""
    import torch

    from services.engine.executor import Engine
    from services.engine.types import EngineRequest, SamplingParams

    before = torch.get_num_threads()
    try:
        eng = Engine(synth_models["tiny-llama"], page_size=4, num_pages=64, intra_op_threads=2)
        assert eng.runner.intra_op_threads == 2
        worker = threading.Thread(target=torch.set_num_threads, args=(1,))  # what host_kv's workers do
        worker.start()
        worker.join()
        seen: list[int] = []
        inherited: list[int] = []
        errors: list[BaseException] = []

        def executor() -> None:  # a fresh thread, as the engine service's step thread is
            try:
                steps()
            except BaseException as e:  # noqa: BLE001 - reported on the test's thread
                errors.append(e)

        def steps() -> None:
            inherited.append(torch.get_num_threads())  # the default a thread inherits: the worker's count
            eng.add_request(EngineRequest("r", eng.tokenizer.encode("hello there"), SamplingParams(temperature=0.0, max_tokens=2)))
            while eng.has_unfinished():
                eng.step()
                seen.append(torch.get_num_threads())
            worker2 = threading.Thread(target=torch.set_num_threads, args=(1,))  # a later worker start
            worker2.start()
            worker2.join()
            eng.add_request(EngineRequest("r2", eng.tokenizer.encode("hello again"), SamplingParams(temperature=0.0, max_tokens=2)))
            while eng.has_unfinished():
                eng.step()
                seen.append(torch.get_num_threads())

        t = threading.Thread(target=executor)
        t.start()
        t.join()
        assert not errors, errors
        assert inherited == [1]
        assert seen and set(seen) == {2}
        with pytest.raises(ValueError):
            Engine(synth_models["tiny-llama"], page_size=4, num_pages=64, intra_op_threads=0)
    finally:
        torch.set_num_threads(before)


def test_a_worker_keeps_its_one_thread_when_the_executor_sets_its_count_later():
    """Issue 42: ATen initialises a thread's count at its first parallel op from the process-wide value, undoing
    a ``set_num_threads(1)`` made before it. The host KV workers set 1 at start and ran their first copy after
    the executor had set 2: each started a second OpenMP pool, libgomp throttled every barrier, and the default
    stack's decode fell to 0.7x after its first checkpoints. ``intra_op.set_thread_count`` sticks; the plain
    call does not (that half pins torch's behaviour, the reason the helper exists)."""
    import torch

    from services.engine.intra_op import set_thread_count

    before = torch.get_num_threads()
    try:
        for setter, expect in ((set_thread_count, 1), (torch.set_num_threads, 2)):
            started, go, seen = threading.Event(), threading.Event(), []

            def worker(setter=setter, started=started, go=go, seen=seen) -> None:
                setter(1)
                started.set()
                go.wait()
                torch.ones(1 << 16).mul_(2)  # its first parallel op
                seen.append(torch.get_num_threads())

            w = threading.Thread(target=worker)
            w.start()
            started.wait()
            ex = threading.Thread(target=set_thread_count, args=(2,))  # the executor's first step
            ex.start()
            ex.join()
            go.set()
            w.join()
            assert seen == [expect], setter
        with pytest.raises(ValueError):
            set_thread_count(0)
    finally:
        torch.set_num_threads(before)
