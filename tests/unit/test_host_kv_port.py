"""The host KV tier holds no engine: it is built from a ``KvPort`` (``kv/port.py``: the KV manager, the pool and
its layout, the measured prefill cost), rebinds to a rebuilt shell's port, and takes its write-back choices
from pure functions (``kv/write_back.py``). Real engines (tiny models, CPU), a real in-process kvstore over
Mooncake TCP on loopback."""

from __future__ import annotations

import pytest

from services.engine.executor import Engine
from services.engine.host_kv import HostKV
from services.engine.kv import KVManager
from services.engine.kv.retention import Hint, RetentionBook
from services.engine.kv.host_tier import decide_restore
from services.engine.kv.write_back import DirtySet, late_sessions, orphaned_sessions, write_now
from services.engine.types import EngineRequest, SamplingParams
from services.kvstore.client import KvStoreClient
from tests.unit.host_kv_fixtures import mooncake, one_thread, run_calls, store  # noqa: F401 - fixtures

PAGE = 4


class _Job:
    def __init__(self, pages: list[int]) -> None:
        self.pages = pages


def test_write_back_triggers_are_pure_choices_over_the_dirty_set():
    kv = KVManager(8, PAGE, clock=lambda: 0.0)
    held, orphan = kv.allocator.allocate(2)
    kv.pin_pages([held, orphan])
    kv.allocator.decref([orphan])  # only its pin holds it now
    dirty = DirtySet()
    dirty.mark("held", _Job([held]))
    dirty.mark("orphan", _Job([held, orphan]))
    assert orphaned_sessions(dirty, kv.only_pinned) == ["orphan"]

    book = RetentionBook(wall=lambda: 100.0)
    book.note("orphan", Hint(t_done_unix=99.0, gap_mu=0.0, gap_sigma=0.5, window_s=0.0))  # no lease: a late return
    book.note("held", Hint(t_done_unix=99.0, gap_mu=0.0, gap_sigma=0.5, window_s=60.0))  # back within the window
    assert late_sessions(dirty, book, 100.0) == ["orphan"]


def test_when_to_write_and_whether_to_restore_are_pure_choices():
    asked = []

    def leaving() -> bool:
        asked.append(1)
        return True

    assert write_now("through", leaving) and asked == []  # write-through never asks the cold engine's queues
    assert write_now("back", leaving) and asked == [1]
    assert not write_now("back", None) and not write_now("back", lambda: False)
    costs = dict(restore_per_token=1e-3, prefill_per_token=1e-4, overhead_s=0.0)
    auto = decide_restore(100, **costs)
    assert not auto.restore and auto.reason == "recompute is cheaper"
    forced = decide_restore(100, **costs, mode="always")
    assert forced.restore and forced.reason == "mode=always" and forced.restore_s == auto.restore_s
    assert not decide_restore(100, restore_per_token=0.0, prefill_per_token=1.0, mode="never").restore
    assert decide_restore(0, **costs, mode="always").reason == "nothing to restore"


def test_the_tier_holds_no_engine_and_rebinds_to_a_rebuilt_shells_port(synth_models, store, mooncake):
    path = synth_models["tiny-llama"]
    e1 = Engine(path, page_size=PAGE, num_pages=64)
    hk = HostKV(e1.kv_port(), KvStoreClient(store.address, timeout_s=2.0), mooncake=mooncake, mode="always", staging_bytes=1 << 20)
    try:
        assert not any(isinstance(v, Engine) for v in vars(hk).values())
        assert hk.kv is e1.kv and hk.layout.page_size == PAGE
        e1.attach_host_kv(hk)
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        run_calls(e1, [EngineRequest("a", list(range(40, 60)), greedy, session_id="s")])
        assert hk.drain(timeout=10) and hk.counters["checkpoints"] == 1

        e2 = Engine(path, page_size=PAGE, num_pages=32)  # a rebuilt shell: another KV manager and pool
        hk.rebind(e2.kv_port())
        assert hk.kv is e2.kv and hk.sessions.get("s") is not None  # the store knowledge carries over
        e2.attach_host_kv(hk)
        assert e2.session_info("s").where == "host"  # the new shell's residency owner asks the tier's index
        with pytest.raises(ValueError, match="another layout"):
            hk.rebind(Engine(path, page_size=2 * PAGE, num_pages=32).kv_port())
    finally:
        hk.close()
