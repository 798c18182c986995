import pytest

from services.engine.kv.allocator import OutOfPagesError, PageAllocator


def test_low_ids_first_and_reuse_lowest():
    a = PageAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    assert a.num_free == 5
    a.decref([1])
    assert a.allocate(2) == [1, 3]
    a.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_refcounts_free_at_zero():
    a = PageAllocator(4)
    (p,) = a.allocate(1)
    a.incref([p])
    assert a.refcount(p) == 2
    assert a.decref([p]) == 0
    assert a.num_free == 3
    assert a.decref([p]) == 1
    assert a.num_free == 4
    a.check_integrity({})


def test_check_then_commit():
    a = PageAllocator(2)
    assert a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(OutOfPagesError):
        a.allocate(3)
    assert a.num_free == 2  # nothing partially allocated


def test_misuse_raises():
    a = PageAllocator(2)
    with pytest.raises(ValueError):
        a.decref([0])
    with pytest.raises(ValueError):
        a.incref([1])
    with pytest.raises(ValueError):
        PageAllocator(0)


def test_integrity_detects_unaccounted_reference():
    a = PageAllocator(3)
    a.allocate(2)
    with pytest.raises(AssertionError):
        a.check_integrity({0: 1})
