"""Engine checkpoint/restore against a real in-process kvstore (gRPC + Mooncake TCP), tiny models, CPU."""

from __future__ import annotations

import threading
import time

import pytest

from services.engine.executor import Engine
from services.engine.host_kv import HostKV
from services.engine.kv.host_tier import HostSessions, decide_restore
from services.engine.types import EngineRequest, SamplingParams
from services.kvstore.client import KvStoreClient
from services.kvstore.server import KvStoreServer
from services.engine import wire
from talaria.config import EngineConfig, KvStoreConfig
from talaria.v1 import engine_pb2
from tests.unit.host_kv_fixtures import mooncake, one_thread, store  # noqa: F401 - fixtures

PAGE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine(path, **kw) -> Engine:
    return Engine(path, page_size=PAGE, num_pages=128, **kw)


def tier(e: Engine, address: str, mc, **kw) -> HostKV:
    kw.setdefault("mode", "always")
    kw.setdefault("staging_bytes", 1 << 20)
    hk = HostKV(e.kv_port(), KvStoreClient(address, timeout_s=1.0), mooncake=mc, retry_after_s=kw.pop("retry_after_s", 0.2), **kw)
    e.attach_host_kv(hk)
    return hk


def call(e: Engine, rid: str, prompt: list[int], session: str = "s"):
    e.add_request(EngineRequest(rid, list(prompt), GREEDY, session_id=session))
    toks, final = [], None
    while final is None:
        for o in e.step():
            toks += o.new_token_ids
            if o.finished:
                final = o
    e.check_integrity()
    return toks, final.usage


def two_turns(e: Engine, prompt: list[int], between=lambda: None, session="s"):
    out1, _ = call(e, f"{session}-1", prompt, session)
    between()
    turn2 = prompt + out1 + [11, 12, 13, 14, 15]
    out2, usage = call(e, f"{session}-2", turn2, session)
    return out1, out2, usage


def prompt_for(e: Engine, n_words: int = 12, head: str = "the session asks the tool ") -> list[int]:
    return e.tokenizer.encode(head + "and then the agent reads it " * n_words)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_restore_after_eviction_equals_uninterrupted(synth_models, store, mooncake, name):
    ref = engine(synth_models[name])
    p = prompt_for(ref)
    ref1, ref2, ref_usage = two_turns(ref, p)  # uninterrupted: the session's KV stays on the device

    e = engine(synth_models[name])
    hk = tier(e, store.address, mooncake)

    def evict():  # the call ended: checkpoint drains, then the device KV is forced out
        assert e.drain_checkpoints(timeout=10)
        assert e.flush_cache() > 0 and e.kv.radix.num_pages == 0

    out1, out2, usage = two_turns(e, p, evict, session=f"s-{name}")
    assert (out1, out2) == (ref1, ref2)
    assert hk.counters["restores"] == 1 and hk.counters["restore_pages"] >= len(p) // PAGE
    assert usage.cached_tokens >= (len(p) // PAGE) * PAGE  # the restored prefix was not recomputed
    # what the tier's threads took from the cores: a copy, checksums and RPCs are never free
    assert 0 < hk.counters["checkpoint_cpu_s"] < 5 and 0 < hk.counters["restore_cpu_s"] < 5
    exported = dict(dict(e.stats().host_kv_counters)[e.model_id])  # what the engine's /metrics reads
    assert exported["checkpoints"] == hk.counters["checkpoints"] >= 1 and exported["restore_cpu_s"] == hk.counters["restore_cpu_s"]
    hk.close()


def test_another_instance_restores_what_one_checkpointed(synth_models, store, mooncake):
    """A session's KV outlives its engine: a new engine process of the same model restores it."""
    path = synth_models["tiny-llama"]
    ref = engine(path)
    p = prompt_for(ref, 20)
    ref1, ref2, _ = two_turns(ref, p)

    a = engine(path)
    hka = tier(a, store.address, mooncake)
    out1, _ = call(a, "a-1", p, "moving")
    assert a.drain_checkpoints(timeout=10)
    hka.close()
    b = engine(path)  # the engine restarted (or another instance of the node)
    hkb = tier(b, store.address, mooncake)
    out2, usage = call(b, "b-2", p + out1 + [11, 12, 13, 14, 15], "moving")
    assert (out1, out2) == (ref1, ref2)
    assert hkb.counters["restores"] == 1 and usage.cached_tokens > 0
    hkb.close()


def test_stale_entries_are_never_restored(synth_models, store, mooncake):
    path = synth_models["tiny-llama"]
    a = engine(path)
    hka = tier(a, store.address, mooncake, revision="rev-1")
    p = prompt_for(a, 9, head="a prompt no other test uses ")
    out1, _ = call(a, "st-1", p, "stale")
    assert a.drain_checkpoints(timeout=10)
    turn2 = p + out1 + [7, 8, 9]
    hka.close()

    for kw, other in (({"revision": "rev-2"}, path), ({}, synth_models["tiny-qwen2"])):  # new weights; other model
        e = engine(other)
        hk = tier(e, store.address, mooncake, **kw)
        toks, usage = call(e, "st-2", turn2, "stale")
        assert hk.counters["restores"] == 0 and usage.cached_tokens == 0
        plain = engine(other)
        assert toks == call(plain, "st-2", turn2, "stale")[0]
        hk.close()

    e = engine(path)  # same model and revision, but the tokens differ from page 0: hash mismatch
    hk = tier(e, store.address, mooncake, revision="rev-1")
    call(e, "st-3", [t + 1 for t in turn2], "stale")
    assert hk.counters["restores"] == 0
    hk.close()


@pytest.mark.parametrize("policy", ["through", "back"])
def test_switch_barrier_drains_device_to_host_copies(synth_models, store, mooncake, policy):
    e = engine(synth_models["tiny-llama"])
    hk = tier(e, store.address, mooncake, write_policy=policy)
    gate = threading.Event()
    real_reserve = hk.client.reserve

    def slow_reserve(*a, **kw):
        gate.wait(10)
        return real_reserve(*a, **kw)

    hk.client.reserve = slow_reserve
    call(e, "b-1", prompt_for(e), f"barrier-{policy}")
    if policy == "through":
        assert hk.outstanding == 1 and len(hk.dirty) == 0 and e.kv.num_transfer_pins > 0  # copy outstanding: pages pinned
    else:
        assert hk.outstanding == 0 and len(hk.dirty) == 1 and e.kv.num_transfer_pins > 0  # dirty: pinned, no copy yet
    e.flush_cache()
    assert e.kv.num_free_pages < e.kv.num_pages  # pinned pages survive the caches letting go
    assert not e.drain_checkpoints(timeout=0.2)  # the barrier holds while the copy is outstanding
    gate.set()
    assert e.drain_checkpoints(timeout=10)
    assert hk.outstanding == 0 and e.kv.num_transfer_pins == 0
    assert e.kv.num_free_pages == e.kv.num_pages  # now the KV region can be released
    assert hk.counters["checkpoints"] == 1
    e.check_integrity()
    hk.close()


def test_store_killed_and_restarted(synth_models, mooncake):
    path = synth_models["tiny-qwen2"]
    ref = engine(path)
    p = prompt_for(ref, 10)
    ref1, ref2, _ = two_turns(ref, p)

    srv = KvStoreServer(KvStoreConfig(capacity_mb=16, slab_kb=4))
    port = srv.start()
    e = engine(path)
    hk = tier(e, srv.address, mooncake, retry_after_s=0.2)
    out1, _ = call(e, "k-1", p, "killed")
    assert e.drain_checkpoints(timeout=10)
    assert hk.snapshot()["sessions"][0]["state"] == "host"
    srv.stop()  # the store dies with the session's KV in it
    e.flush_cache()
    out2, usage = call(e, "k-2", p + out1 + [11, 12, 13, 14, 15], "killed")  # restore fails: recompute
    assert (out1, out2) == (ref1, ref2)
    assert hk.counters["store_failures"] >= 1 and hk.counters["restores"] == 0
    assert e.drain_checkpoints(timeout=10)  # the checkpoint of the second call is dropped, never hangs
    assert hk.snapshot()["sessions"][0]["state"] == "missing"

    srv2 = KvStoreServer(KvStoreConfig(capacity_mb=16, slab_kb=4, port=port))  # restarted, empty
    srv2.start()
    try:
        deadline = time.monotonic() + 10
        while not hk.client.healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.25)  # past retry_after_s
        e.flush_cache()
        out3, _ = call(e, "k-3", p, "killed2")  # checkpoint into the new store (new epoch)
        assert e.drain_checkpoints(timeout=10)
        assert hk.epoch == srv2.epoch and hk.snapshot()["available"]
        e.flush_cache()
        out4, usage = call(e, "k-4", p + out3 + [11, 12, 13, 14, 15], "killed2")
        assert (out3, out4) == (ref1, ref2) and hk.counters["restores"] == 1
    finally:
        hk.close()
        srv2.stop()


def test_restore_or_recompute_uses_measured_costs():
    d = decide_restore(1000, restore_per_token=2e-6, prefill_per_token=1e-4, overhead_s=0.002)
    assert d.restore and d.restore_s == pytest.approx(0.004) and d.recompute_s == pytest.approx(0.1)
    d = decide_restore(16, restore_per_token=2e-6, prefill_per_token=1e-4, overhead_s=0.002)
    assert not d.restore and d.reason == "recompute is cheaper"  # short prefix: round trips dominate
    assert not decide_restore(0, restore_per_token=0, prefill_per_token=1).restore


def test_auto_mode_declines_when_recompute_is_cheaper(synth_models, store, mooncake):
    e = engine(synth_models["tiny-llama"])
    hk = tier(e, store.address, mooncake, mode="auto", restore_per_token_prior=1.0)  # absurdly slow restores
    p = prompt_for(e, 8, head="declined restores start here ")
    out1, _ = call(e, "d-1", p, "decline")
    assert e.drain_checkpoints(timeout=10)
    e.flush_cache()
    call(e, "d-2", p + out1, "decline")
    assert hk.counters["restores"] == 0 and hk.counters["restores_declined"] == 1
    assert not hk.last_decision.restore and hk.last_decision.restore_s > hk.last_decision.recompute_s
    hk.close()


def test_host_sessions_state():
    s = HostSessions(max_entries=2)
    s.committed("a", 16, epoch=1, now_unix=0)
    assert s.state("a", 1, True) == "host"
    assert s.state("a", 2, True) == "missing"  # the store restarted
    assert s.state("a", 1, False) == "missing"  # unreachable
    assert s.state("b", 1, True) == "missing"
    s.committed("b", 4, 1, 0)
    s.committed("c", 4, 1, 0)
    assert s.get("a") is None and len(s.entries()) == 2


def test_slow_restore_never_stalls_running_decodes(synth_models, store, mooncake, monkeypatch):
    """Issue 19 #3: a restore runs off the executor thread. While the store read is held back, another
    call keeps decoding one token per step, the restoring call is not scheduled and its reserved pages are
    held (integrity holds); once the read completes the call joins the batch and its tokens equal
    recomputation."""
    import services.engine.host_kv as host_kv_mod

    path = synth_models["tiny-llama"]
    ref = engine(path)
    p = prompt_for(ref, 14, head="slow restore session ")
    ref1, ref2, _ = two_turns(ref, p)

    e = engine(path)
    hk = tier(e, store.address, mooncake)
    out1, _ = call(e, "slow-1", p, "slow")
    assert e.drain_checkpoints(timeout=10)
    assert e.session_info("slow").where == "device"
    e.flush_cache()
    info = e.session_info("slow")  # the device entry is gone: the typed answer says the KV is in the store
    assert info is not None and info.where == "host" and info.committed_tokens == (len(p) + len(out1) - 1) // PAGE * PAGE
    snap = wire.instance_snapshot(EngineConfig(id="e0", models=[e.model_id]), e.stats(), [], epoch=1, seq=1, draining=False, rounds=0)
    assert [(x.session_id, x.state) for x in snap.sessions] == [("slow", engine_pb2.KV_HOST)]
    assert snap.profile.restore_per_token == hk.restore_per_token.value > 0

    gate, entered = threading.Event(), threading.Event()
    real_read = host_kv_mod.read_pages

    def slow_read(*a, **kw):
        entered.set()
        assert gate.wait(30), "test gate never opened"
        return real_read(*a, **kw)

    monkeypatch.setattr(host_kv_mod, "read_pages", slow_read)
    other = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    e.add_request(EngineRequest("busy", e.tokenizer.encode("an unrelated call decodes meanwhile"), other))
    while not e.scheduler.running or e.scheduler.running[0].num_completion_tokens == 0:
        e.step()
    e.add_request(EngineRequest("slow-2", p + out1 + [11, 12, 13, 14, 15], GREEDY, session_id="slow"))
    toks2: list[int] = []
    while not entered.is_set():  # the restore reaches the store read
        for o in e.step():
            assert o.request_id == "busy"
    busy = e.outputs.requests["busy"].seq
    before = busy.num_completion_tokens
    for _ in range(5):  # the read is stuck: the other call still decodes a token every step
        for o in e.step():
            assert o.request_id == "busy" and not o.finished
    assert busy.num_completion_tokens == before + 5
    assert e.kv.num_restoring_pages > 0 and hk.num_restoring == 1  # the restore holds its pages
    assert all(s.request_id != "slow-2" for s in e.scheduler.running)
    e.check_integrity()
    gate.set()
    final = None
    while final is None:
        for o in e.step():
            if o.request_id == "slow-2":
                toks2 += o.new_token_ids
                final = o if o.finished else None
    assert toks2 == ref2  # restored KV gives the tokens of recomputation
    assert final.usage.restored_tokens > 0 and hk.counters["restores"] == 1
    assert e.kv.num_restoring_pages == 0
    e.check_integrity()
    hk.close()


def test_abort_during_restore_releases_everything(synth_models, store, mooncake, monkeypatch):
    import services.engine.host_kv as host_kv_mod

    path = synth_models["tiny-llama"]
    e = engine(path)
    hk = tier(e, store.address, mooncake)
    p = prompt_for(e, 10, head="aborted restore session ")
    out1, _ = call(e, "ab-1", p, "abort")
    assert e.drain_checkpoints(timeout=10)
    e.flush_cache()
    gate, entered = threading.Event(), threading.Event()
    real_read = host_kv_mod.read_pages

    def slow_read(*a, **kw):
        entered.set()
        assert gate.wait(30)
        return real_read(*a, **kw)

    monkeypatch.setattr(host_kv_mod, "read_pages", slow_read)
    e.add_request(EngineRequest("ab-2", p + out1, GREEDY, session_id="abort"))
    while not entered.is_set():
        e.step()
    e.abort("ab-2")
    outs = e.step()
    assert [o.finish_reason.value for o in outs if o.request_id == "ab-2"] == ["abort"]
    gate.set()
    assert e.drain_checkpoints(timeout=10)  # the barrier waits for the restore, which ends published
    assert not e.has_unfinished() and hk.num_restoring == 0 and e.kv.num_restoring_pages == 0
    e.check_integrity()
    assert e.flush_cache() > 0 and e.kv.num_free_pages == e.kv.num_pages
    hk.close()
