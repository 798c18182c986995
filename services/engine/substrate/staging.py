"""D2D weight staging into the high-address tail of the KV pool (Talaria §4.4) — the mechanism.

Geometry. The active model's KV pool is ``[2, L, num_pages * P, kv_heads, head_dim]``: ``2L`` layer blocks,
and in every block page ``p`` is one contiguous *segment* of ``seg_bytes``. A staging *slot* is ``k``
consecutive pages of one block (``k = ceil(chunk_bytes / seg_bytes)``), so each weight chunk is contiguous.
Slots are numbered from the top: slot ``s`` is in block ``s % 2L`` at level ``s // 2L``, covering pages
``[num_pages - (level+1)k, num_pages - level*k)``. Filling slots in order therefore consumes the same
high page ids of every layer block first — the tail the page allocator (which hands out low ids first)
reaches last.

States of a staged chunk: WRITING (copy in flight; its pages are *fenced*: the allocator skips them) →
CLEAN → DIRTY (a KV allocation took a page of its slot; sticky). Only CLEAN chunks may be copied D2D at a
switch; DIRTY or missing ones come from the bank. Slots are only used when all their pages are free and
their addresses lie above the target model's weights region (so the switch's gather never overwrites a
staged source). ``slack_bytes`` is the staging space still usable: free, unfenced slots not holding a clean
chunk.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from services.engine.kv import OutOfPagesError, PageAllocator

from .copier import Copier, Ticket


class ChunkState(str, Enum):
    WRITING = "writing"
    CLEAN = "clean"
    DIRTY = "dirty"


@dataclass(frozen=True, slots=True)
class KVGeometry:
    kv_start: int  # arena offset of the pool
    num_pages: int
    num_blocks: int  # 2 * layers
    seg_bytes: int  # one page of one block

    @property
    def block_bytes(self) -> int:
        return self.num_pages * self.seg_bytes


@dataclass(slots=True)
class StagedChunk:
    model: str
    index: int
    slot: int
    addr: int  # arena offset of the staged copy
    nbytes: int
    state: ChunkState
    ticket: Ticket | None = None


class StagingArea:
    """Staging slots over the active model's KV pool, and the chunks staged in them."""

    def __init__(self, geom: KVGeometry, chunk_bytes: int, *, max_fraction: float = 1.0) -> None:
        self.geom = geom
        self.chunk_bytes = chunk_bytes
        self.k = -(-chunk_bytes // geom.seg_bytes)  # pages per slot
        max_pages = int(geom.num_pages * max(0.0, min(1.0, max_fraction)))
        self.levels = max_pages // self.k if self.k <= geom.num_pages else 0
        self.num_slots = self.levels * geom.num_blocks
        self.chunks: dict[int, StagedChunk] = {}  # slot -> chunk
        self.by_index: dict[tuple[str, int], StagedChunk] = {}
        self.fenced: dict[int, int] = {}  # page -> number of WRITING chunks over it (slots of a level share pages)
        self.dirty_bytes = 0  # bytes of staged chunks made dirty since the area was created

    # ------------------------------------------------------------------ geometry
    def slot_pages(self, s: int) -> range:
        level = s // self.geom.num_blocks
        hi = self.geom.num_pages - level * self.k
        return range(hi - self.k, hi)

    def slot_addr(self, s: int) -> int:
        g = self.geom
        return g.kv_start + (s % g.num_blocks) * g.block_bytes + self.slot_pages(s).start * g.seg_bytes

    def slots_of_page(self, p: int) -> range:
        level = (self.geom.num_pages - 1 - p) // self.k
        if level >= self.levels:
            return range(0)
        b = self.geom.num_blocks
        return range(level * b, (level + 1) * b)

    # ------------------------------------------------------------------ allocator hooks
    def on_allocate(self, pages: list[int]) -> None:
        """Pages were handed out: every staged chunk overlapping them becomes DIRTY."""
        for p in pages:
            for s in self.slots_of_page(p):
                c = self.chunks.get(s)
                if c is not None and c.state is not ChunkState.DIRTY:
                    assert c.state is not ChunkState.WRITING, f"page {p} of a chunk being written was allocated"
                    c.state = ChunkState.DIRTY
                    self.dirty_bytes += c.nbytes

    # ------------------------------------------------------------------ staging
    def free_slots(self, is_used: Callable[[int], bool], min_addr: int, limit: int | None = None) -> list[int]:
        """Slots (top first) with no chunk, no used or fenced page, entirely above ``min_addr``; the first
        ``limit`` of them when given (the scan stops there: it runs at step boundaries, over every slot)."""
        out: list[int] = []
        if limit is not None and limit <= 0:
            return out
        for s in range(self.num_slots):
            c = self.chunks.get(s)
            if c is not None and c.state is not ChunkState.DIRTY:
                continue
            if self.slot_addr(s) < min_addr:
                continue
            pages = self.slot_pages(s)
            if any(is_used(p) or p in self.fenced for p in pages):
                continue
            out.append(s)
            if limit is not None and len(out) >= limit:
                break
        return out

    def stage(self, model: str, index: int, slot: int, nbytes: int, start_copy: Callable[[int], Ticket]) -> StagedChunk:
        """Fence ``slot``'s pages and start copying chunk ``index`` of ``model`` into it."""
        if nbytes > self.k * self.geom.seg_bytes:
            raise ValueError(f"chunk of {nbytes} bytes does not fit a slot of {self.k * self.geom.seg_bytes}")
        old = self.chunks.pop(slot, None)
        if old is not None:
            self.by_index.pop((old.model, old.index), None)
        prev = self.by_index.get((model, index))
        if prev is not None:  # restaging a dirty chunk elsewhere
            self.chunks.pop(prev.slot, None)
        for p in self.slot_pages(slot):
            self.fenced[p] = self.fenced.get(p, 0) + 1
        addr = self.slot_addr(slot)
        c = StagedChunk(model, index, slot, addr, nbytes, ChunkState.WRITING)
        self.chunks[slot] = c
        self.by_index[(model, index)] = c
        c.ticket = start_copy(addr)
        return c

    def poll(self, wait: bool = False) -> None:
        """Retire finished writes: WRITING -> CLEAN, unfence their pages."""
        for c in self.chunks.values():
            if c.state is ChunkState.WRITING and c.ticket is not None and (wait or c.ticket.done()):
                c.ticket.sync()
                c.state = ChunkState.CLEAN
                c.ticket = None
                for p in self.slot_pages(c.slot):
                    n = self.fenced[p] - 1
                    if n:
                        self.fenced[p] = n
                    else:
                        del self.fenced[p]

    def discard(self, keep_model: str | None = None) -> None:
        """Forget staged chunks of every model except ``keep_model`` (waits for their writes first)."""
        self.poll(wait=True)
        for s, c in list(self.chunks.items()):
            if c.model != keep_model:
                del self.chunks[s]
                self.by_index.pop((c.model, c.index), None)

    def discard_keys(self, keep) -> int:
        """Forget staged chunks whose ``(model, index)`` is not in ``keep`` (waits for writes first; a residency plan releases what it does not keep). Returns chunks forgotten."""
        self.poll(wait=True)
        n = 0
        for s, c in list(self.chunks.items()):
            if (c.model, c.index) not in keep:
                del self.chunks[s]
                self.by_index.pop((c.model, c.index), None)
                n += 1
        return n

    def clean(self, model: str) -> dict[int, StagedChunk]:
        return {i: c for (m, i), c in self.by_index.items() if m == model and c.state is ChunkState.CLEAN}

    def staged_models(self) -> set[str]:
        return {c.model for c in self.chunks.values() if c.state is not ChunkState.DIRTY}

    def slack_bytes(self, is_used: Callable[[int], bool]) -> int:
        return len(self.free_slots(is_used, 0)) * self.k * self.geom.seg_bytes

    def check(self, is_used: Callable[[int], bool]) -> None:
        """A CLEAN chunk has no used page; a WRITING chunk's pages are fenced and free."""
        for c in self.chunks.values():
            pages = self.slot_pages(c.slot)
            if c.state is ChunkState.CLEAN:
                assert not any(is_used(p) for p in pages), f"clean chunk {c.model}#{c.index} overlaps used pages"
            if c.state is ChunkState.WRITING:
                assert all(p in self.fenced and not is_used(p) for p in pages)


class StagingAwareAllocator(PageAllocator):
    """The page allocator with the staging hooks: skips fenced pages, reports allocations to the area.

    ``area`` is set while its model is active (``None`` otherwise); lowest free ids are still handed out
    first, so the staging tail is reached last."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages)
        self.area: StagingArea | None = None

    def _fenced_free(self) -> int:
        a = self.area
        return sum(1 for p in a.fenced if self._ref[p] == 0) if a is not None and a.fenced else 0

    @property
    def num_free(self) -> int:
        return len(self._free) - self._fenced_free()

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def is_used(self, page: int) -> bool:
        return self._ref[page] > 0

    def allocate(self, n: int) -> list[int]:
        a = self.area
        if a is None or not a.fenced:
            pages = super().allocate(n)
        else:
            if n < 0:
                raise ValueError(f"cannot allocate {n} pages")
            if n > self.num_free:
                raise OutOfPagesError(f"asked for {n} pages, {self.num_free} free (fenced pages excluded)")
            pages, skipped = [], []
            while len(pages) < n:
                p = heapq.heappop(self._free)
                (skipped if p in a.fenced else pages).append(p)
            for p in skipped:
                heapq.heappush(self._free, p)
            for p in pages:
                self._ref[p] = 1
        if a is not None:
            a.on_allocate(pages)
        return pages


def start_copy_fn(copier: Copier, arena_bytes: Callable[[int, int], object], src) -> Callable[[int], Ticket]:
    """A ``start_copy`` for :meth:`StagingArea.stage`: copy ``src`` (a bank chunk, so across the copier's weight
    link) to arena ``addr``."""
    n = src.numel()
    return lambda addr: copier.submit(arena_bytes(addr, addr + n), src, from_host=True)
