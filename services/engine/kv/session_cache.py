"""Per-session KV entries kept between the calls of an agent session.

Design: after a call with a ``session_id`` ends, the session keeps its *committed* tokens (prompt plus the
generated tokens whose KV was written) and the page list holding them, including the partial last page
that the radix cache cannot hold (partial pages have no hash identity, Talaria §4.3). The entry holds one
allocator reference per page so the pages stay addressable. On the session's next call the block manager
``take``s the entry (the call consumes it): it reuses the pages that cover the longest common prefix of the
new prompt and the committed tokens and releases the rest. A partially matching last page is written in
place only when the call holds it exclusively, otherwise it is copied first (copy-on-write; decided by
the block manager).

The cache is bounded by number of entries and by number of pages held; inserting past a bound evicts
entries in least-recently-used order (dropping their references; full pages that were also inserted into
the radix cache stay there).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.engine.kv.allocator import PageAllocator

if TYPE_CHECKING:
    from services.engine.kv.retention import RetentionBook


@dataclass(slots=True)
class SessionEntry:
    session_id: str
    token_ids: list[int]  # committed tokens (KV written for every one of them)
    pages: list[int]  # ceil(len(token_ids) / page_size) pages
    last_access: float


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionCache:
    def __init__(
        self,
        allocator: PageAllocator,
        clock: Callable[[], float],
        max_entries: int = 256,
        max_pages: int | None = None,
    ) -> None:
        self._alloc = allocator
        self._clock = clock
        self.max_entries = max_entries
        self.max_pages = max_pages
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()  # LRU first
        self._num_pages = 0
        self.retention: RetentionBook | None = None  # evict by predicted return (None: plain LRU)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    @property
    def num_pages(self) -> int:
        """Page references held by all entries."""
        return self._num_pages

    def entries(self) -> list[SessionEntry]:
        return list(self._entries.values())

    def peek(self, session_id: str) -> SessionEntry | None:
        """The entry of ``session_id`` without changing anything (not even LRU order)."""
        return self._entries.get(session_id)

    def put(self, session_id: str, token_ids: list[int], pages: list[int]) -> int:
        """Store an entry; the caller *transfers* one reference per page to the cache.

        Replaces (and releases) a previous entry of the session, then evicts LRU entries past the bounds
        (an entry larger than ``max_pages`` is not kept at all). Returns pages freed.
        """
        freed = self.drop(session_id)
        self._entries[session_id] = SessionEntry(session_id, list(token_ids), list(pages), self._clock())
        self._num_pages += len(pages)
        while self._entries and (
            len(self._entries) > self.max_entries
            or (self.max_pages is not None and self._num_pages > self.max_pages)
        ):
            freed += self.evict_lru()
        return freed

    def take(self, session_id: str) -> SessionEntry | None:
        """Remove and return the entry; its page references pass to the caller."""
        e = self._entries.pop(session_id, None)
        if e is not None:
            self._num_pages -= len(e.pages)
        return e

    def drop(self, session_id: str) -> int:
        """Remove the entry and release its references. Returns pages freed."""
        e = self.take(session_id)
        return self._alloc.decref(e.pages) if e is not None else 0

    def evict_lru(self, protect: str | None = None) -> int:
        """Release the least recently used entry (other than ``protect``). Returns pages freed
        (0 also when nothing could be evicted; see ``len``). With a retention book attached, the entry
        whose return is least likely soon goes first (``kv/retention.py``); LRU among equals."""
        if self.retention is not None:
            sid = self.retention.victim(self._entries, protect)
            return self.drop(sid) if sid is not None else 0
        for sid in self._entries:
            if sid != protect:
                return self.drop(sid)
        return 0

    def num_evictable(self, protect: str | None = None) -> int:
        return sum(1 for sid in self._entries if sid != protect)

    def clear(self) -> int:
        freed = 0
        while self._entries:
            freed += self.evict_lru()
        return freed

    def check_integrity(self, page_size: int) -> None:
        total = 0
        for e in self._entries.values():
            need = -(-len(e.token_ids) // page_size)
            assert len(e.pages) == need, f"session {e.session_id}: {len(e.pages)} pages for {len(e.token_ids)} tokens"
            for p in e.pages:
                assert self._alloc.refcount(p) >= 1, f"session {e.session_id} holds free page {p}"
            total += len(e.pages)
        assert total == self._num_pages, "session page count out of sync"
