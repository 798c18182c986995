"""Page allocator: which KV pages are free, and how many owners each used page has.

Design: a min-heap free list so that the *lowest* free page ids are handed out first (the high end of the
pool is left for weight staging later), plus a reference count per page. A page is owned by every holder
that took a reference (a running request's page table, a radix-cache node, a session-cache entry); it
returns to the free list when the last reference is dropped. Check-then-commit: ``can_allocate(n)``
before ``allocate(n)``; ``allocate`` raises rather than partially allocating.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """``allocate`` was asked for more pages than are free (callers should have asked ``can_allocate``)."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # already a valid min-heap
        self._ref: list[int] = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (lowest ids first), each with reference count 1. Mutates the free list."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each (already used) page."""
        for p in pages:
            if self._ref[p] <= 0:
                raise ValueError(f"incref of free page {p}")
            self._ref[p] += 1

    def decref(self, pages: Iterable[int]) -> int:
        """Drop one reference from each page; pages reaching zero go back to the free list.

        Returns the number of pages freed by this call.
        """
        freed = 0
        for p in pages:
            if self._ref[p] <= 0:
                raise ValueError(f"decref of free page {p}")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                heapq.heappush(self._free, p)
                freed += 1
        return freed

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Assert internal consistency; with ``expected_refs`` (page -> count of known holders), also that
        every used page is accounted for exactly. Raises AssertionError."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate page in free list"
        for p in range(self.num_pages):
            r = self._ref[p]
            assert r >= 0, f"page {p} has negative refcount"
            assert (r == 0) == (p in free), f"page {p}: refcount {r} but free={p in free}"
        if expected_refs is not None:
            for p in range(self.num_pages):
                want = expected_refs.get(p, 0)
                assert self._ref[p] == want, f"page {p}: refcount {self._ref[p]}, holders {want}"
