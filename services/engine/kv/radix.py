"""Prefix cache over page-aligned blocks, keyed by cumulative page hash.

Design (Talaria §4.3: entries keyed by cumulative prefix hash; shaped like SGLang's RadixCache, in words):
each node is one *full* page of KV. Because page hash ``h_i`` already folds in the whole prefix
(``talaria.hashing``), a node is identified by its hash alone and the tree is a dict ``hash -> node`` with
parent links; the longest cached prefix of a request is found by walking its hash chain until a miss.
Partial pages have no identity and are never inserted.

Ownership: the tree holds one allocator reference on every node's page. A request using a matched path
``lock``s it (lock count on every node of the path), so the path is never evicted while in use; the
request additionally takes its own page references (done by the block manager, not here).
Eviction removes unlocked *leaf* nodes in least-recently-used order (the clock is injected), dropping the
tree's reference; a page is freed only when no request or session entry still holds it. Evicting a leaf
may turn its parent into an evictable leaf.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.engine.kv.allocator import PageAllocator


@dataclass(slots=True)
class RadixNode:
    hash: int
    parent: int | None  # parent's hash; None for the first page of a chain
    page: int
    last_access: float
    num_children: int = 0
    lock_ref: int = 0


class RadixCache:
    def __init__(self, allocator: PageAllocator, clock: Callable[[], float]) -> None:
        self._alloc = allocator
        self._clock = clock
        self._nodes: dict[int, RadixNode] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, h: int) -> bool:
        return h in self._nodes

    @property
    def num_pages(self) -> int:
        return len(self._nodes)

    def pages(self) -> list[int]:
        """Pages the tree holds a reference on (one per node)."""
        return [n.page for n in self._nodes.values()]

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Pages of the longest cached prefix of ``hashes``.

        Mutates only the last-access time of the matched nodes (set to now). The pages are safe to use
        only after the caller has ``lock``ed the path and taken its own references.
        """
        now = self._clock()
        pages: list[int] = []
        for h in hashes:
            node = self._nodes.get(h)
            if node is None:
                break
            node.last_access = now
            pages.append(node.page)
        return pages

    def insert(self, hashes: Sequence[int], pages: Sequence[int]) -> int:
        """Insert the chain ``hashes[i] -> pages[i]`` (full pages, a prefix from page 0).

        Existing nodes keep their page (the caller's duplicate page is left untouched) and are touched;
        new nodes take one allocator reference on their page. Returns the number of new nodes.
        """
        if len(hashes) != len(pages):
            raise ValueError("hashes and pages differ in length")
        now = self._clock()
        parent: int | None = None
        added = 0
        for h, p in zip(hashes, pages):
            node = self._nodes.get(h)
            if node is None:
                self._alloc.incref([p])
                self._nodes[h] = RadixNode(h, parent, p, now)
                if parent is not None:
                    self._nodes[parent].num_children += 1
                added += 1
            else:
                node.last_access = now
            parent = h
        return added

    def lock(self, hashes: Sequence[int]) -> None:
        """Protect the cached path ``hashes`` (which must all be present) from eviction."""
        for h in hashes:
            self._nodes[h].lock_ref += 1

    def unlock(self, hashes: Sequence[int]) -> None:
        """Undo one ``lock`` of the same path; touches the nodes (the request just used them)."""
        now = self._clock()
        for h in hashes:
            node = self._nodes[h]
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of unlocked node {h:#x}")
            node.lock_ref -= 1
            node.last_access = now

    def num_evictable(self) -> int:
        """Nodes that are not locked (a node whose descendant is locked is locked too)."""
        return sum(1 for n in self._nodes.values() if n.lock_ref == 0)

    def evict(self, n_pages: int) -> tuple[int, int]:
        """Evict up to ``n_pages`` unlocked leaf nodes, least recently used first.

        Drops the tree's reference on each evicted page. Returns ``(nodes_evicted, pages_freed)``; a page
        still held by a request or a session entry is unlinked from the tree but not freed.
        """
        if n_pages <= 0:
            return 0, 0
        heap = [(n.last_access, n.hash) for n in self._nodes.values() if n.num_children == 0 and n.lock_ref == 0]
        heapq.heapify(heap)
        evicted = freed = 0
        while heap and evicted < n_pages:
            _, h = heapq.heappop(heap)
            node = self._nodes.pop(h)
            freed += self._alloc.decref([node.page])
            evicted += 1
            if node.parent is not None:
                parent = self._nodes[node.parent]
                parent.num_children -= 1
                if parent.num_children == 0 and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.hash))
        return evicted, freed

    def drop_leaves(self, hashes: Sequence[int]) -> int:
        """A session ended: remove the chain ``hashes`` (page 0 first) from its last page backwards
        while each node is an unlocked leaf, so prefixes other chains extend stay. Returns pages freed."""
        freed = 0
        for h in reversed(list(hashes)):
            node = self._nodes.get(h)
            if node is None:
                continue
            if node.num_children or node.lock_ref:
                break
            del self._nodes[h]
            freed += self._alloc.decref([node.page])
            if node.parent is not None:
                self._nodes[node.parent].num_children -= 1
        return freed

    def clear(self) -> int:
        """Drop every unlocked node (repeated leaf eviction). Returns pages freed."""
        return self.evict(len(self._nodes))[1]

    def check_integrity(self) -> None:
        children: dict[int, int] = {}
        for n in self._nodes.values():
            if n.parent is not None:
                assert n.parent in self._nodes, f"node {n.hash:#x} has a missing parent"
                children[n.parent] = children.get(n.parent, 0) + 1
                assert self._nodes[n.parent].lock_ref >= n.lock_ref, "child locked more than its parent"
            assert self._alloc.refcount(n.page) >= 1, f"node {n.hash:#x} holds free page {n.page}"
        for n in self._nodes.values():
            assert n.num_children == children.get(n.hash, 0), f"node {n.hash:#x} child count"
