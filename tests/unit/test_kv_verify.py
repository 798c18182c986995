"""The engine's host tier in issue 14: verified restore (item 5: per-page checksums recorded at commit,
checked before a restore publishes the pages) and the end of a session (item 4: device entry, own radix pages
and kvstore chain released, shared prefixes kept). Real in-process kvstore (gRPC + Mooncake TCP), tiny
synthesized models, CPU."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from services.engine import host_kv as host_kv_mod
from services.engine.executor import Engine
from services.engine.host_kv import HostKV
from services.engine.kv_verify import ALGO, page_checksums, verify_pages
from services.engine.types import EngineRequest, SamplingParams
from services.kvstore.client import KvStoreClient
from services.kvstore.server import KvStoreServer
from talaria.v1 import kvstore_pb2 as kpb
from tests.unit.host_kv_fixtures import mooncake, one_thread, store  # noqa: F401 - fixtures

PAGE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_verify_pages_finds_the_first_bad_page():
    buf = bytearray(range(256)) * 4  # 4 pages of 256 bytes
    sums = page_checksums(buf, 256, 4)
    assert sums == [zlib.crc32(bytes(buf[i * 256 : (i + 1) * 256])) for i in range(4)]
    blocks = [kpb.Block(has_checksum=True, checksum=c, checksum_algo=ALGO) for c in sums]
    assert verify_pages(buf, 256, blocks) == (4, 0)
    buf[2 * 256 + 7] ^= 0x01  # one bit of page 2
    assert verify_pages(buf, 256, blocks) == (2, 0)
    blocks[0] = kpb.Block()  # committed without a checksum: accepted, counted as unverified
    assert verify_pages(buf, 256, blocks[:2]) == (2, 1)


def _call(e: Engine, rid: str, prompt: list[int], session: str):
    e.add_request(EngineRequest(rid, list(prompt), GREEDY, session_id=session))
    toks, final = [], None
    while final is None:
        for o in e.step():
            toks += o.new_token_ids
            if o.finished:
                final = o
    e.check_integrity()
    return toks, final.usage


def _corrupt_one_block(srv: KvStoreServer, hk: HostKV, prompt: list[int], e: Engine, page_index: int) -> None:
    """Overwrite the store's pool bytes of one committed page (after commit) with NaN patterns."""
    n = len(prompt) // PAGE
    hashes = e.kv.extend_hashes([], prompt[: n * PAGE], e.salt)[:n]
    with srv.servicer.lock:
        res = srv.registry.lookup(hk.layout, hashes)
    b = next(b for b in res.blocks if b.page_index == page_index)
    assert b.checksum is not None and b.checksum_algo == ALGO  # recorded at commit
    for ext in b.extents:
        srv.pool.array[ext.offset : ext.offset + ext.length] = np.uint8(0xFF)


def _turns(e: Engine, prompt: list[int], session: str, between=lambda: None):
    out1, _ = _call(e, f"{session}-1", prompt, session)
    between()
    out2, usage = _call(e, f"{session}-2", prompt + out1 + [11, 12, 13, 14, 15], session)
    return out1, out2, usage


@pytest.mark.parametrize("verify", [True, False])
def test_corrupted_store_bytes_are_recomputed_not_served(synth_models, store, mooncake, monkeypatch, verify):
    """A page corrupted in the store after commit is caught at restore: the tokens equal a cold run's and the
    failure is counted. With the check disabled the same corruption changes the tokens (the test can fail)."""
    path = synth_models["tiny-llama"]
    cold = Engine(path, page_size=PAGE, num_pages=128)
    prompt = cold.tokenizer.encode("the verified session asks the tool " + "and the agent reads it " * 12)
    ref1, ref2, _ = _turns(cold, prompt, "cold")  # no host tier at all: the reference tokens

    if not verify:
        monkeypatch.setattr(host_kv_mod, "verify_pages", lambda buf, pb_, blocks: (len(blocks), 0))
    e = Engine(path, page_size=PAGE, num_pages=128)
    hk = HostKV(e.kv_port(), KvStoreClient(store.address, timeout_s=1.0), mooncake=mooncake, mode="always", staging_bytes=1 << 20, retry_after_s=0.2)
    e.attach_host_kv(hk)
    session = f"verify-{verify}"
    bad_page = 3

    def evict_and_corrupt():
        assert e.drain_checkpoints(timeout=10)
        assert e.flush_cache() > 0
        _corrupt_one_block(store, hk, prompt, e, bad_page)

    out1, out2, usage = _turns(e, prompt, session, evict_and_corrupt)
    assert out1 == ref1
    if verify:
        assert out2 == ref2
        assert hk.counters["restore_verify_failures"] == 1
        assert hk.counters["restores"] == 1 and usage.cached_tokens == bad_page * PAGE  # the verified prefix only
        assert hk.snapshot()["restore_verify_failures"] == 1
    else:
        assert out2 != ref2  # what verification prevents
    hk.close()


def test_checksums_travel_with_the_blocks(store):
    """Commit records one checksum per block; lookups return it; a length mismatch is refused."""
    from talaria.kv_layout import Family, Layout

    c = KvStoreClient(store.address, timeout_s=1.0)
    lay = Layout("ck-model@r", 0, 1, 4, "uint8", Family.MHA, (4096,), 4096)
    r = c.reserve(lay, [101, 102])
    with pytest.raises(ValueError):
        c.commit(r.lease_id, [b.block_id for b in r.blocks], checksums=[1])
    c.commit(r.lease_id, [b.block_id for b in r.blocks], checksums=[7, 8], checksum_algo=ALGO)
    got = c.lookup(lay, [101, 102])
    assert [(b.has_checksum, b.checksum, b.checksum_algo) for b in got.blocks] == [(True, 7, ALGO), (True, 8, ALGO)]
    c.close()


def test_end_session_releases_device_and_store_pages_but_not_shared_prefixes(synth_models, store, mooncake):
    path = synth_models["tiny-llama"]
    e = Engine(path, page_size=PAGE, num_pages=128)
    hk = HostKV(e.kv_port(), KvStoreClient(store.address, timeout_s=1.0), mooncake=mooncake, mode="always", staging_bytes=1 << 20, retry_after_s=0.2)
    e.attach_host_kv(hk)
    shared = e.tokenizer.encode("a system prompt both sessions of this test share " * 3)
    shared = shared[: len(shared) // PAGE * PAGE]
    a = shared + e.tokenizer.encode(" session a asks the tool about the weather")
    b = shared + e.tokenizer.encode(" session b asks the tool about the markets")
    _call(e, "a-1", a, "end-a")
    _call(e, "b-1", b, "end-b")
    assert e.drain_checkpoints(timeout=10)
    stats0 = store.servicer.stats()
    free0 = e.kv.num_free_pages
    freed = e.end_session("end-a")
    assert freed > 0 and e.kv.num_free_pages == free0 + freed and e.kv.sessions.peek("end-a") is None
    assert e.drain_checkpoints(timeout=10)  # the release runs on the host-tier worker, after queued checkpoints
    assert hk.counters["sessions_released"] == 1 and hk.counters["released_pages"] > 0
    assert store.servicer.stats().entries == stats0.entries - hk.counters["released_pages"]
    n = len(shared) // PAGE
    hashes = e.kv.extend_hashes([], shared, e.salt)[:n]
    with store.servicer.lock:
        assert store.registry.lookup(hk.layout, hashes).pages == n  # the shared prefix stays (b extends it)
    assert all(h in e.kv.radix for h in hashes)
    assert e.end_session("end-a") == 0  # idempotent
    out, usage = _call(e, "b-2", b + [5, 6, 7], "end-b")  # the other session is untouched
    assert usage.cached_tokens >= len(b) // PAGE * PAGE
    e.check_integrity()
    hk.close()
