from services.engine.kv.allocator import PageAllocator
from services.engine.kv.session_cache import SessionCache, common_prefix_len


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0


def test_put_take_transfers_references():
    a = PageAllocator(8)
    s = SessionCache(a, Clock())
    pages = a.allocate(2)
    s.put("s1", [1, 2, 3, 4, 5], pages)
    assert s.num_pages == 2 and a.num_free == 6
    e = s.take("s1")
    assert e.pages == pages and e.token_ids == [1, 2, 3, 4, 5]
    assert "s1" not in s and s.num_pages == 0
    assert a.num_free == 6  # the caller now holds the references
    a.decref(e.pages)
    assert a.num_free == 8


def test_replace_and_lru_bounds():
    a = PageAllocator(16)
    clock = Clock()
    s = SessionCache(a, clock, max_entries=2, max_pages=5)
    s.put("a", [1] * 4, a.allocate(1))
    clock.t = 1
    s.put("b", [2] * 8, a.allocate(2))
    clock.t = 2
    s.put("a", [3] * 4, a.allocate(1))  # replaces a (old page released); a is now most recent
    assert a.num_free == 16 - 3
    s.put("c", [4] * 4, a.allocate(1))  # 3 entries > 2: LRU 'b' goes
    assert [e.session_id for e in s.entries()] == ["a", "c"]
    assert a.num_free == 16 - 2
    s.put("d", [5] * 20, a.allocate(5))  # 7 pages > 5: evict a, then c
    assert [e.session_id for e in s.entries()] == ["d"]
    assert s.num_pages == 5 and a.num_free == 11
    s.check_integrity(page_size=4)


def test_evict_protect():
    a = PageAllocator(4)
    s = SessionCache(a, Clock())
    s.put("a", [1], a.allocate(1))
    assert s.num_evictable(protect="a") == 0
    assert s.evict_lru(protect="a") == 0 and len(s) == 1
    assert s.evict_lru() == 1 and len(s) == 0
