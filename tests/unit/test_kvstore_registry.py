"""Host KV registry (pure): slabs, prefix lookup, the three invariants' store-side parts, eviction."""

from __future__ import annotations

import pytest

from services.kvstore.registry import LRU, Family, HostKVRegistry, Layout, LayoutError, ValuePerByte


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


PAGE_BYTES = 4096
SLAB = 1024  # 4 slabs per page


def layout(model="m@r1", rank=0, tp=1, page_bytes=PAGE_BYTES, dtype="float32", page_size=16) -> Layout:
    return Layout(model, rank, tp, page_size, dtype, Family.MHA, (2, 2, page_size, 2, 8), page_bytes)


def reg(pages=16, policy=None, clock=None) -> HostKVRegistry:
    return HostKVRegistry(pages * PAGE_BYTES, SLAB, clock=clock or Clock(), policy=policy)


def put(r: HostKVRegistry, lay: Layout, hashes) -> int:
    res = r.reserve(lay, hashes)
    r.commit(res.lease_id, [b.block_id for b in res.blocks])
    return len(res.blocks)


def test_reserve_commit_lookup_longest_prefix():
    r = reg()
    lay = layout()
    assert put(r, lay, [1, 2, 3]) == 3
    res = r.lookup(lay, [1, 2, 3, 4])
    assert res.pages == 3 and [b.prefix_hash for b in res.blocks] == [1, 2, 3]
    assert r.lookup(lay, [1, 9, 3]).pages == 1  # hash mismatch at page 1 ends the prefix
    # extending the chain reserves only the new pages
    res = r.reserve(lay, [1, 2, 3, 4])
    assert res.present_pages == 3 and [b.page_index for b in res.blocks] == [3]
    r.check_integrity()


def test_extents_cover_page_bytes_and_slabs_are_shared_across_layouts():
    r = reg(pages=4)
    a = layout(model="a@1", page_bytes=3000)  # 3 slabs, last partly used
    b = layout(model="b@1", page_bytes=2048)  # another model and size, same pool
    put(r, a, [1])
    put(r, b, [7, 8])
    va = r.lookup(a, [1]).blocks[0]
    assert sum(e.length for e in va.extents) == 3000
    assert r.slabs_free == 16 - 3 - 2 - 2
    vb = r.lookup(b, [7, 8]).blocks
    offsets = {e.offset for v in (va, *vb) for e in v.extents}
    assert len(offsets) == 3  # disjoint, contiguous runs
    r.check_integrity()


def test_copy_not_complete_is_invisible():
    r = reg()
    lay = layout()
    res = r.reserve(lay, [1, 2])
    assert r.lookup(lay, [1, 2]).pages == 0  # reserved, copy not complete
    assert r.reserve(lay, [1, 2]).present_pages == 2  # and not reserved twice
    r.commit(res.lease_id, [res.blocks[0].block_id])
    assert r.lookup(lay, [1, 2]).pages == 1  # only the committed page
    r.commit(res.lease_id, [res.blocks[1].block_id])
    assert r.lookup(lay, [1, 2]).pages == 2
    r.check_integrity()


def test_aborted_or_expired_write_frees_slabs():
    clock = Clock()
    r = reg(clock=clock)
    lay = layout()
    res = r.reserve(lay, [1, 2], lease_s=5)
    assert r.slabs_free == 64 - 8
    r.commit(res.lease_id, [b.block_id for b in res.blocks], abort=True)
    assert r.slabs_free == 64 and r.lookup(lay, [1]).pages == 0
    r.reserve(lay, [1, 2], lease_s=5)  # the writer dies
    clock.t = 6
    assert r.expire() == 1
    assert r.slabs_free == 64 and r.counters.expired_leases == 1
    r.check_integrity()


def test_tp_prefix_agreement_publishes_only_the_agreed_range():
    r = reg()
    l0, l1 = layout(rank=0, tp=2), layout(rank=1, tp=2)
    put(r, l0, [1, 2, 3])
    assert r.lookup(l0, [1, 2, 3]).pages == 0  # rank 1 has reported nothing yet
    put(r, l1, [1, 2, 33])  # rank 1 disagrees at page 2
    res = r.lookup(l0, [1, 2, 3])
    assert res.pages == 2 and res.note == "tp_disagreement"
    assert r.lookup(l1, [1, 2, 33]).pages == 2
    # the disagreeing tails stay private: committed, but never returned by any lookup
    assert r.visible(l0, 3) and r.visible(l1, 33)
    put(r, l1, [1, 2, 3])  # rank 1 catches up with the same hash: agreement extends
    assert r.lookup(l0, [1, 2, 3]).pages == 3
    r.check_integrity()


def test_pins_and_references_are_separate_counts():
    r = reg()
    lay = layout()
    put(r, lay, [1, 2])
    read = r.lookup(lay, [1, 2], pin=True)
    blk = r.block(read.blocks[1].block_id)
    assert blk.pins == 1 and blk.refs == 1
    assert r.release("m@r1", 0, [2]) == 1  # the index forgets the block: reference gone ...
    assert blk.refs == 0 and blk.pins == 1
    assert r.lookup(lay, [1, 2]).pages == 1  # ... so it is no longer visible ...
    free_before = r.slabs_free
    assert r.block(blk.id) is not None and blk.slabs  # ... but its slabs are not reclaimed under the reader
    assert r.unpin(read.lease_id, read_complete=True) == 2
    assert r.block(blk.id) is None and r.slabs_free == free_before + 4  # both zero: reclaimed
    assert r.counters.restores == 1 and r.counters.bytes_out == 2 * PAGE_BYTES
    r.check_integrity()


def test_pinned_block_is_not_evicted_and_capacity_misses_are_counted():
    r = reg(pages=2)
    lay = layout()
    put(r, lay, [1, 2])
    read = r.lookup(lay, [1, 2], pin=True)
    res = r.reserve(lay, [10, 11])  # full, and everything pinned
    assert res.lease_id == 0 and res.capacity_miss_pages == 2
    assert r.counters.capacity_miss_pages == 2 and r.lookup(lay, [1, 2]).pages == 2
    r.unpin(read.lease_id)
    res = r.reserve(lay, [10])  # now a leaf can go
    assert len(res.blocks) == 1 and r.counters.evictions == 1
    assert r.lookup(lay, [1, 2]).pages == 1  # the leaf (page 2) went, never the middle of a chain
    r.check_integrity()


def test_lru_evicts_least_recently_used_chain_tail():
    clock = Clock()
    r = reg(pages=4, clock=clock, policy=LRU())
    lay = layout()
    put(r, lay, [1, 2])
    clock.t = 1
    put(r, lay, [5, 6])
    clock.t = 2
    r.lookup(lay, [1, 2])  # touch chain 1
    clock.t = 3
    put(r, lay, [9])
    assert r.lookup(lay, [5, 6]).pages == 1 and r.lookup(lay, [1, 2]).pages == 2
    r.check_integrity()


def test_value_per_byte_keeps_hot_long_prefixes():
    clock = Clock()
    r = reg(pages=4, clock=clock, policy=ValuePerByte(half_life_s=10))
    lay = layout()
    put(r, lay, [1, 2, 3])  # a 3-page chain, read twice
    r.lookup(lay, [1, 2, 3])
    r.lookup(lay, [1, 2, 3])
    put(r, lay, [7])  # a cold single page
    clock.t = 5
    put(r, lay, [8])  # needs one page: the cold single page is worth less per byte
    assert r.lookup(lay, [7]).pages == 0 and r.lookup(lay, [1, 2, 3]).pages == 3
    r.check_integrity()


def test_stale_entries_are_never_returned():
    r = reg()
    put(r, layout(model="m@r1"), [1, 2])
    assert r.lookup(layout(model="other@r1"), [1, 2]).pages == 0  # other model
    assert r.lookup(layout(model="m@r2"), [1, 2]).pages == 0  # other weights revision
    stale = r.lookup(layout(model="m@r1", dtype="bfloat16", page_bytes=2048), [1, 2])  # other layout
    assert stale.pages == 0 and stale.note == "layout_mismatch" and r.counters.stale_lookups == 1
    assert r.lookup(layout(model="m@r1"), [3, 2]).pages == 0  # hash mismatch
    r.check_integrity()


def test_release_drops_descendants_and_whole_models():
    r = reg()
    lay = layout()
    put(r, lay, [1, 2, 3])
    put(r, lay, [1, 2, 4])  # a branch
    assert r.release("m@r1", 0, [2]) == 3  # 2 and both children
    assert r.lookup(lay, [1, 2]).pages == 1
    put(r, layout(model="x@1"), [1])
    assert r.release("m@r1", 0, all_of_model=True) == 1
    assert r.num_entries == 1 and r.lookup(layout(model="x@1"), [1]).pages == 1
    r.check_integrity()


def test_commit_of_orphan_is_dropped():
    r = reg()
    lay = layout()
    put(r, lay, [1])
    res = r.reserve(lay, [1, 2])
    r.release("m@r1", 0, [1])  # the parent disappears while page 2 is being written
    assert r.commit(res.lease_id, [b.block_id for b in res.blocks]) == (0, 1)
    assert r.lookup(lay, [1, 2]).pages == 0
    r.check_integrity()


def test_invalid_layouts_are_refused():
    r = reg()
    with pytest.raises(LayoutError):
        r.reserve(layout(rank=2, tp=2), [1])
    with pytest.raises(LayoutError):
        r.reserve(layout(page_bytes=0), [1])
    with pytest.raises(LayoutError):
        r.lookup(layout(page_bytes=10**12), [1])
