from talaria.hashing import page_hashes

from services.engine.kv.allocator import PageAllocator
from services.engine.kv.radix import RadixCache


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(n=16):
    clock = Clock()
    a = PageAllocator(n)
    return a, RadixCache(a, clock), clock


def insert_owned(a, r, hashes):
    """Allocate pages as a request would, insert them, drop the request's references."""
    pages = a.allocate(len(hashes))
    r.insert(hashes, pages)
    a.decref(pages)
    return pages


def test_match_longest_prefix():
    a, r, _ = make()
    hs = page_hashes(list(range(12)), 4)
    pages = insert_owned(a, r, hs)
    assert r.match(hs) == pages
    other = page_hashes(list(range(8)) + [99, 98, 97, 96], 4)
    assert other[:2] == hs[:2] and other[2] != hs[2]
    assert r.match(other) == pages[:2]
    assert r.match(page_hashes([5, 5, 5, 5], 4)) == []
    r.check_integrity()


def test_insert_takes_reference_and_keeps_duplicates():
    a, r, _ = make()
    hs = page_hashes(list(range(8)), 4)
    p1 = a.allocate(2)
    assert r.insert(hs, p1) == 2
    assert [a.refcount(p) for p in p1] == [2, 2]
    p2 = a.allocate(3)
    hs3 = page_hashes(list(range(12)), 4)
    assert r.insert(hs3, p2) == 1  # first two pages exist: existing pages kept
    assert r.match(hs3) == [p1[0], p1[1], p2[2]]
    assert [a.refcount(p) for p in p2] == [1, 1, 2]
    a.decref(p1)
    a.decref(p2)
    assert a.num_free == 16 - 3
    a.check_integrity({p1[0]: 1, p1[1]: 1, p2[2]: 1})
    r.check_integrity()


def test_evict_lru_leaves_only():
    a, r, clock = make()
    base = list(range(8))
    ha = page_hashes(base + [1, 1, 1, 1], 4)
    hb = page_hashes(base + [2, 2, 2, 2], 4)
    clock.t = 1.0
    pa = insert_owned(a, r, ha)
    clock.t = 2.0
    pb = a.allocate(1)
    r.insert(hb, pa[:2] + pb)
    a.decref(pb)
    assert len(r) == 4
    clock.t = 3.0
    r.match(ha)  # touch branch a: b's leaf is now LRU
    evicted, freed = r.evict(1)
    assert (evicted, freed) == (1, 1)
    assert r.match(hb) == pa[:2]
    assert r.match(ha) == pa
    # shared parents are leaves only once both children are gone: evicting 3 more empties the tree
    assert r.evict(10) == (3, 3)
    assert len(r) == 0 and a.num_free == 16
    r.check_integrity()


def test_lock_blocks_eviction_and_unlock_releases():
    a, r, clock = make()
    hs = page_hashes(list(range(8)), 4)
    insert_owned(a, r, hs)
    r.lock(hs[:1])  # locking the first page only: the second is an unlocked leaf
    assert r.evict(5) == (1, 1)
    assert r.evict(5) == (0, 0)
    assert r.num_evictable() == 0
    r.unlock(hs[:1])
    assert r.evict(5) == (1, 1)
    a.check_integrity({})


def test_evict_page_still_held_elsewhere_is_not_freed():
    a, r, _ = make()
    hs = page_hashes(list(range(4)), 4)
    pages = a.allocate(1)
    r.insert(hs, pages)  # request still holds its reference
    assert r.evict(1) == (1, 0)
    assert a.refcount(pages[0]) == 1
