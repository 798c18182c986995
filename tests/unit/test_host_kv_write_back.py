"""Host KV write-back (``kv/write_back.py``, issue 12 item 3): a session's pages are copied to the kvstore only
when they are about to leave the device. Real engines (tiny models, CPU), a real in-process kvstore over
Mooncake TCP on loopback; outputs compared with engines that never had a host tier."""

from __future__ import annotations

import time

import pytest

from services.engine.executor import Engine
from services.engine.host_kv import HostKV
from services.engine.kv.retention import Hint, RetentionBook
from services.engine.slots import SlotPolicy
from services.engine.cold.engine import ColdEngine
from services.engine.cold.slotted import SlotSwitching
from services.engine.types import EngineRequest, SamplingParams
from services.kvstore.client import KvStoreClient
from tests.unit.host_kv_fixtures import mooncake, one_thread, run_calls, store  # noqa: F401 - fixtures

PAGE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
A, B = "tiny-llama", "tiny-qwen2"


def tier(e: Engine, address: str, mc, **kw) -> HostKV:
    kw.setdefault("write_policy", "back")
    hk = HostKV(e.kv_port(), KvStoreClient(address, timeout_s=2.0), mooncake=mc, mode="always", staging_bytes=1 << 20, retry_after_s=0.2, **kw)
    e.attach_host_kv(hk)
    return hk


def call(e: Engine, rid: str, prompt: list[int], session: str):
    toks = run_calls(e, [EngineRequest(rid, list(prompt), GREEDY, session_id=session)])
    e.check_integrity()
    return toks[rid + ":tokens"], toks[rid].usage


def cold_with_tier(synth_models, store, mooncake) -> ColdEngine:
    """A slotted cold engine over A and B (A active), each model with a write-back host tier on ``store``."""
    ce = ColdEngine(
        {m: synth_models[m] for m in (A, B)}, switching=SlotSwitching(SlotPolicy(ttft_s=5.0, tpot_s=0.5)), page_size=PAGE,
        kv_cache_bytes=8 << 20, chunk_bytes=256 * 1024, runtime_bytes=64 * 1024, initial=A,
    )
    ce.attach_host_kv_factory(lambda port: HostKV(port, KvStoreClient(store.address, timeout_s=2.0), mooncake=mooncake, mode="always", staging_bytes=1 << 20, write_policy="back"))
    return ce


def test_evicted_under_memory_pressure_is_written_back_and_restored_equal_to_recompute(synth_models, store, mooncake):
    path = synth_models[A]
    a_prompt = list(range(100, 180))  # 20 pages
    b_prompt = list(range(300, 420))  # 30 pages: with A's pages held, 48 pages cannot fit it
    ref = Engine(path, page_size=PAGE, num_pages=256)  # no host tier, nothing ever evicted
    ref_a1, _ = call(ref, "a1", a_prompt, "A")
    ref_b1, _ = call(ref, "b1", b_prompt, "B")
    a2_prompt = a_prompt + ref_a1 + [7, 8, 9, 10, 11]
    ref_a2, _ = call(ref, "a2", a2_prompt, "A")

    e = Engine(path, page_size=PAGE, num_pages=48)
    hk = tier(e, store.address, mooncake)
    out_a1, _ = call(e, "a1", a_prompt, "wb-A")
    assert hk.counters["checkpoints"] == 0 and len(hk.dirty) == 1  # write-back: dirty, nothing copied yet
    out_b1, _ = call(e, "b1", b_prompt, "wb-B")  # needs A's pages: evicted, written back first, then freed
    assert hk.counters["write_backs_eviction"] >= 1 and "wb-A" not in hk.dirty
    assert hk.drain(timeout=10)  # the Mooncake write and Commit finish on the worker
    assert hk.counters["checkpoints"] >= 1 and hk.sessions.get("wb-A") is not None
    assert e.kv.sessions.peek("wb-A") is None and e.kv.radix.match(e.kv.extend_hashes([], a_prompt)) == []  # A left the device
    out_a2, usage = call(e, "a2", a2_prompt, "wb-A")
    assert (out_a1, out_b1, out_a2) == (ref_a1, ref_b1, ref_a2)
    assert hk.counters["restores"] == 1 and usage.restored_tokens >= (len(a_prompt) // PAGE) * PAGE
    hk.close()
    assert e.kv.num_transfer_pins == 0
    e.check_integrity()


def test_hot_engine_without_eviction_writes_nothing_and_session_end_drops_dirty_state(synth_models, store, mooncake):
    path = synth_models[A]
    ref = Engine(path, page_size=PAGE, num_pages=256)
    e = Engine(path, page_size=PAGE, num_pages=256)
    hk = tier(e, store.address, mooncake)
    history = {s: list(range(10 + 50 * i, 50 + 50 * i)) for i, s in enumerate(("hot-1", "hot-2"))}
    for turn in range(3):
        for sid, prompt in history.items():
            want, _ = call(ref, f"{sid}-{turn}", prompt, sid)
            got, usage = call(e, f"{sid}-{turn}", prompt, sid)
            assert got == want
            if turn:
                assert usage.cached_tokens > 0 and usage.restored_tokens == 0  # the device kept it
            history[sid] = prompt + got + [1, 2, 3]
    assert hk.counters["dirty_marked"] == 6 and len(hk.dirty) == 2
    assert hk.counters["checkpoints"] == 0 and hk.counters["checkpoint_pages"] == 0 and hk.outstanding == 0
    pinned = e.kv.num_transfer_pins
    assert pinned == hk.dirty.num_pages > 0  # one pin per dirty page, the newest chain of each session only
    e.end_session("hot-1")
    assert hk.counters["dirty_dropped"] == 1 and "hot-1" not in hk.dirty and e.kv.num_transfer_pins < pinned
    e.end_session("hot-2")
    assert hk.drain(timeout=10)
    assert e.kv.num_transfer_pins == 0 and hk.counters["checkpoints"] == 0  # ended sessions are never written
    e.check_integrity()
    hk.close()


def test_write_through_copies_every_call_at_once(synth_models, store, mooncake):
    e = Engine(synth_models[A], page_size=PAGE, num_pages=256)
    hk = tier(e, store.address, mooncake, write_policy="through")
    prompt = list(range(500, 560))
    out, _ = call(e, "wt-1", prompt, "wt")
    call(e, "wt-2", prompt + out + [4, 5, 6], "wt")
    assert hk.drain(timeout=10)
    assert hk.counters["checkpoints"] == 2 and hk.counters["dirty_marked"] == 0 and len(hk.dirty) == 0
    assert hk.sessions.get("wt") is not None and e.kv.num_transfer_pins == 0
    hk.close()


def test_retention_hint_expecting_a_late_return_writes_back_at_once(synth_models, store, mooncake):
    e = Engine(synth_models[A], page_size=PAGE, num_pages=256)
    hk = tier(e, store.address, mooncake)
    book = RetentionBook(time.time)
    e.attach_retention(book)
    call(e, "h-1", list(range(600, 660)), "late")
    call(e, "h-2", list(range(700, 760)), "soon")
    assert len(hk.dirty) == 2
    now = time.time()
    book.note("late", Hint(now, 0.0, 0.0, 0.0))  # no lease: its return is expected after the window
    book.note("soon", Hint(now, 0.0, 0.0, 30.0))  # a fixed lease of 30 s: expected within it
    e.step()  # the executor's poll sees the new hints
    assert hk.counters["write_backs_hint"] == 1 and list(hk.dirty.sessions()) == ["soon"]
    assert hk.drain(timeout=10) and hk.sessions.get("late") is not None
    hk.close()


def test_cold_switch_writes_back_the_outgoing_models_dirty_sessions_and_a_return_restores(synth_models, store, mooncake):
    ce = cold_with_tier(synth_models, store, mooncake)
    prompt = list(range(800, 860))
    first = run_calls(ce, [EngineRequest("c1", prompt, GREEDY, session_id="cold", model=A)])
    hk = ce.shell(A).host_kv
    assert hk.write_policy == "back" and len(hk.dirty) == 1 and hk.counters["checkpoints"] == 0
    run_calls(ce, [EngineRequest("other", list(range(5, 30)), GREEDY, model=B)])  # switches away from A
    assert ce.active == B
    assert hk.counters["write_backs_switch"] + hk.counters["write_backs_slot_end"] == 1 and len(hk.dirty) == 0
    assert ce.shell(A).kv.num_transfer_pins == 0  # the barrier let the pages go; the store write may go on
    assert hk.drain(timeout=10) and hk.counters["checkpoints"] == 1
    turn2 = prompt + first["c1:tokens"] + [3, 4, 5, 6]
    second = run_calls(ce, [EngineRequest("c2", turn2, GREEDY, session_id="cold", model=A)])
    assert second["c2"].usage.restored_tokens >= (len(prompt) // PAGE) * PAGE
    ref = Engine(synth_models[A], page_size=PAGE, num_pages=256)
    r1 = run_calls(ref, [EngineRequest("c1", prompt, GREEDY, session_id="cold")])["c1:tokens"]
    r2 = run_calls(ref, [EngineRequest("c2", turn2, GREEDY, session_id="cold")])["c2:tokens"]
    assert (first["c1:tokens"], second["c2:tokens"]) == (r1, r2)
    # a call of A that ends while B has queued calls: the next switch takes A's KV off the device, so it is
    # written at once (HostKV.leaving_soon), not left dirty for the barrier
    before = hk.counters["checkpoints"]
    ce.add_request(EngineRequest("c3", list(range(900, 960)), GREEDY, session_id="cold-3", model=A))
    for _ in range(10_000):  # until c3 produced its first token on A (its slot is open)
        if any(o.request_id == "c3" for o in ce.step()):
            break
    run_calls(ce, [EngineRequest("b2", list(range(40, 70)), GREEDY, model=B)])  # queued while c3 decodes
    assert hk.drain(timeout=10)
    assert ce.active == B and hk.counters["write_backs_next_switch"] == 1 and hk.counters["checkpoints"] == before + 2  # c2 dirty at the barrier, c3 at its end
    assert len(hk.dirty) == 0 and ce.shell(A).kv.num_transfer_pins == 0


def test_switch_barrier_releases_the_device_pages_without_waiting_for_the_store(synth_models, store, mooncake):
    """The cold switch barrier waits for the device->host copies, not for the store: with the store's Reserve
    held (a slow store), a switch away from A still completes, A's dirty session copied to host memory at the
    barrier; the session is not published as stored until its commit; once the store answers, it is committed
    and a return restores it with the tokens of recomputation."""
    import threading

    ce = cold_with_tier(synth_models, store, mooncake)
    prompt = list(range(1000, 1060))
    first = run_calls(ce, [EngineRequest("s1", prompt, GREEDY, session_id="slow-store", model=A)])
    hk = ce.shell(A).host_kv
    assert len(hk.dirty) == 1
    gate, entered = threading.Event(), threading.Event()
    reserve = hk.client.reserve

    def held_reserve(*a, **kw):  # the store answers only once the test lets it
        entered.set()
        assert gate.wait(30), "the test never released the store"
        return reserve(*a, **kw)

    hk.client.reserve = held_reserve
    turn2 = prompt + first["s1:tokens"] + [3, 4, 5, 6]
    try:
        run_calls(ce, [EngineRequest("other", list(range(5, 30)), GREEDY, model=B)])  # switches away from A
        assert ce.active == B and hk.counters["switch_host_copies"] == 1
        assert ce.shell(A).kv.num_transfer_pins == 0 and hk.outstanding == 1  # pages released, the write still pending
        assert hk.counters["checkpoints"] == 0 and hk.sessions.get("slow-store") is None  # nothing published before the commit
        # the session returns before its write is committed: it waits for the commit (off the executor
        # thread), it does not recompute
        ce.add_request(EngineRequest("s2", turn2, GREEDY, session_id="slow-store", model=A))
        for _ in range(10_000):
            assert not any(o.request_id == "s2" for o in ce.step())
            if ce.active == A and hk.num_restoring == 1:
                break
        else:
            pytest.fail("the return was not held for the session's checkpoint")
        assert hk.counters["checkpoints"] == 0
    finally:
        gate.set()
    out: list[int] = []
    for _ in range(10_000):
        done = [o for o in ce.step() if o.request_id == "s2"]
        out += [t for o in done for t in o.new_token_ids]
        if any(o.finished for o in done):
            usage = next(o for o in done if o.finished).usage
            break
    else:
        pytest.fail("the return did not finish")
    assert hk.drain(timeout=10) and entered.is_set() and hk.counters["checkpoints"] == 2  # s1, and s2 the drain wrote back
    assert usage.restored_tokens >= (len(prompt) // PAGE) * PAGE
    second = {"s2:tokens": out}
    ref = Engine(synth_models[A], page_size=PAGE, num_pages=256)
    r1 = run_calls(ref, [EngineRequest("s1", prompt, GREEDY, session_id="slow-store")])["s1:tokens"]
    r2 = run_calls(ref, [EngineRequest("s2", turn2, GREEDY, session_id="slow-store")])["s2:tokens"]
    assert (first["s1:tokens"], second["s2:tokens"]) == (r1, r2)
    assert ce.shell(A).kv.num_transfer_pins == hk.dirty.num_pages  # only s2's dirty chain holds pins now
