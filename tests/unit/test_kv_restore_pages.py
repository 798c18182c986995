"""The KV manager owns every page of a host restore (issue 19 #3): pure, no torch, no store.

``match_prefix`` says how much of a prompt is on the device and how much more a host index may hold;
``reserve_restore`` holds the device part and allocates the rest (evicting other caches, never the path it
holds); ``adopt_restore`` publishes the landed pages into the radix cache, locked until admission;
``cancel_restore`` gives everything back. Integrity (every reference accounted for) holds at each step."""

from __future__ import annotations

from services.engine.kv.host_tier import StoreIndex
from services.engine.kv.manager import KVManager
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence

P = 4


def manager(pages: int = 16) -> KVManager:
    t = [0.0]

    def clock() -> float:
        t[0] += 1.0
        return t[0]

    return KVManager(pages, P, clock=clock)


def test_match_prefix_reports_device_and_host_pages():
    kv = manager()
    toks = list(range(100, 118))  # 4 full pages + 2
    hashes = kv.extend_hashes([], toks)
    kv.radix.insert(hashes[:1], kv.allocator.allocate(1))
    kv.allocator.decref(kv.radix.pages())  # the radix cache holds page 0
    idx = StoreIndex()
    m = kv.match_prefix(toks, hashes, "", host=idx)
    assert (m.device_pages, m.host_pages) == (1, 0)  # outside a session, an unknown next page is not asked for
    assert kv.match_prefix(toks, hashes, "s", host=idx).host_pages == 3  # a session call asks the store
    idx.committed("s", hashes, len(hashes) * P, epoch=1, now_unix=0.0)
    assert kv.match_prefix(toks, hashes, "", host=idx).host_pages == 3  # known stored pages are asked for
    assert kv.match_prefix(toks, hashes, "").host_pages == 0  # no host index: device only
    assert kv.session_prefix("s", toks, idx) == ("host", 16)
    assert kv.session_prefix("nobody", toks, idx) == ("missing", 0)


def test_reserve_holds_pages_and_adopt_publishes_them_locked_until_admission():
    kv = manager(8)
    toks = list(range(50, 67))  # 4 full pages + 1
    hashes = kv.extend_hashes([], toks)
    kv.radix.insert(hashes[:1], kv.allocator.allocate(1))
    kv.allocator.decref(kv.radix.pages())
    res = kv.reserve_restore(toks, hashes, "", 3)
    assert res is not None and len(res.chain) == 1 and len(res.pages) == 3
    assert kv.num_restoring_pages == 3
    kv.check_integrity()
    assert kv.flush() == 0  # the held chain survives the caches letting go: the restore holds it
    assert kv.num_free_pages == 8 - 4
    kv.check_integrity()
    hold = kv.adopt_restore(res, 2)  # only two pages landed: the third is freed
    assert hold == hashes[:3] and kv.num_restoring_pages == 0
    assert kv.radix.match(hashes) == [*res.chain, *res.pages[:2]]
    assert kv.num_free_pages == 8 - 3
    assert kv.flush() == 0  # locked for the waiting sequence
    kv.check_integrity()

    seq = Sequence("r", toks)
    seq.hashes = list(hashes)
    seq.kv_hold = hold
    sch = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    sch.add(seq)
    out = sch.schedule()
    assert out.summary() == [("r", len(toks) - 12)]  # the restored prefix is a cache hit
    assert seq.kv_hold == [] and seq.num_cached_tokens == 12
    sch.check_integrity()
    sch.finish(seq, cache=False)
    assert kv.flush() == 3 and kv.num_free_pages == 8
    kv.check_integrity()


def test_cancel_gives_everything_back_and_reserve_evicts_other_entries_only():
    kv = manager(6)
    other = list(range(200, 212))  # 3 full pages of another prompt, cached
    oh = kv.extend_hashes([], other)
    kv.radix.insert(oh, kv.allocator.allocate(3))
    kv.allocator.decref(kv.radix.pages())
    toks = list(range(10, 26))
    hashes = kv.extend_hashes([], toks)
    res = kv.reserve_restore(toks, hashes, "", 4)  # 3 free: evicts the other prompt's leaves for the 4th
    assert res is not None and len(res.pages) == 4 and kv.radix.num_pages < 3
    kv.check_integrity()
    kv.cancel_restore(res)
    assert kv.num_restoring_pages == 0 and kv.num_free_pages == 6 - kv.radix.num_pages
    kv.check_integrity()
    assert kv.reserve_restore(toks, hashes, "", 0) is None


def test_reserve_never_reaches_past_what_the_source_agreed_to():
    """The device prefix may grow between the store's lookup and the reservation (another call of the session
    finished): the reservation is bounded by the hashes the store agreed to, never beyond."""
    kv = manager(12)
    toks = list(range(70, 90))  # 5 full pages
    hashes = kv.extend_hashes([], toks)
    kv.sessions.put("s", toks[:13], kv.allocator.allocate(4))  # the session entry holds 3 full pages (+1 partial)
    assert kv.reserve_restore(toks, hashes[:2], "s", 10) is None  # the store agreed to 2 pages: nothing to restore
    res = kv.reserve_restore(toks, hashes[:4], "s", 10)
    assert res is not None and len(res.chain) == 3 and len(res.pages) == 1
    kv.check_integrity()
    kv.cancel_restore(res)
    kv.check_integrity()
