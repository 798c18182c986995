"""Host KV registry: slabs, entries, prefix lookup, TP agreement, pins vs references, eviction (no I/O).

Design (Talaria §4.3, Appendices B-C; JointServe §3.2):

* **One slab pool for every model and layout.** Host memory is cut into fixed-size slabs; an entry (one
  page of one TP rank) takes ``ceil(page_bytes / slab_bytes)`` slabs, lowest free ids first, so a page's
  slabs and consecutive pages usually form one contiguous run (few, large transfers). Evicted slabs go
  back to the same pool whatever the model or attention family.
* **Entries** are keyed by ``(model, tp_rank, prefix_hash)`` and carry a :class:`Layout` descriptor. The
  model string includes the weights revision and the hash chain is salted with both, so another model,
  another revision or other tokens never match; a layout that differs (page size, dtype, family, slab
  shape) is refused and counted as stale.
* **Copy-not-complete invisibility.** ``reserve`` creates *reserved* blocks that no lookup sees; only
  ``commit`` (the writer's copy completed) publishes them into the index.
* **Prefix agreement (Appendix B).** ``lookup`` returns the longest page-aligned prefix on which *every*
  TP rank ``0..tp_size-1`` committed the same hash for the same model and layout; a disagreeing or
  lagging tail stays private (committed but never returned) and is recomputed.
* **Lifetime separation (Appendix B).** A block has ``refs`` (the index points to it: prefix metadata)
  and ``pins`` (transfers in flight: a writer before commit, readers between lookup and unpin), counted
  separately. Eviction and ``release`` only drop the reference; the slabs return to the pool when both
  counts are zero, so a block being read is never reused under the reader.
* **Eviction** removes committed, unpinned *leaves* of a chain (a block with no committed or reserved
  child), so a stored prefix never gets a hole. The order is a one-method policy
  (``priority(block, now)``, lowest first): :class:`LRU`, or :class:`ValuePerByte` (JointServe §3.2:
  estimated avoided recovery per byte, ``p̂·ĉ/s``, with ``ĉ`` growing with the page's position because
  prefill of late tokens attends over more context). Pages that cannot get slabs even after eviction are
  *capacity misses* and are counted.
* **Leases.** Every pin belongs to a lease with a deadline (clock injected), so an engine that dies in the
  middle of a copy cannot pin slabs forever: ``expire`` aborts its reservation or drops its read pins.

The registry is not thread-safe; the server serializes calls with one lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from talaria.kv_layout import Family, Layout  # noqa: F401 - shared with the engine; re-exported here
from talaria.return_prob import LogGapFit


class LayoutError(ValueError):
    """A layout descriptor that cannot describe stored state (bad sizes, rank out of range)."""


def check_layout(layout: Layout, max_page_bytes: int) -> None:
    if not layout.model:
        raise LayoutError("layout.model is empty")
    if layout.tp_size < 1 or not 0 <= layout.tp_rank < layout.tp_size:
        raise LayoutError(f"tp_rank {layout.tp_rank} outside tp_size {layout.tp_size}")
    if layout.page_size < 1:
        raise LayoutError("layout.page_size must be positive")
    if layout.page_bytes < 1 or layout.page_bytes > max_page_bytes:
        raise LayoutError(f"layout.page_bytes {layout.page_bytes} outside [1, {max_page_bytes}]")


class BlockState(str, Enum):
    RESERVED = "reserved"  # slabs allocated, copy in progress: invisible
    COMMITTED = "committed"  # copy complete: visible once indexed


Key = tuple[str, int, int]  # (model, tp_rank, prefix_hash)


@dataclass(slots=True)
class Block:
    id: int
    key: Key
    layout: Layout
    parent: Key | None
    page_index: int
    slabs: list[int]
    state: BlockState = BlockState.RESERVED
    pins: int = 0  # transfers in flight (writer until commit, readers until unpin)
    refs: int = 0  # prefix metadata pointing at the block (the index)
    children: int = 0  # indexed or reserved blocks whose parent is this one
    created: float = 0.0
    last_access: float = 0.0
    read_last: bool = False  # the last access was a lookup (a write right after it is the same call's, not a return)
    hits: int = 0
    checksum: int | None = None  # the writer's checksum of the page bytes, recorded at commit
    checksum_algo: str = ""

    @property
    def hash(self) -> int:
        return self.key[2]


@dataclass(frozen=True, slots=True)
class Extent:
    """``length`` bytes at ``offset`` of the pool."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BlockView:
    """What a client needs to move one page: where its bytes are."""

    block_id: int
    prefix_hash: int
    page_index: int
    extents: tuple[Extent, ...]
    checksum: int | None = None  # recorded at commit (None: committed without one, or not yet)
    checksum_algo: str = ""


@dataclass(frozen=True, slots=True)
class ReserveResult:
    lease_id: int  # 0 when nothing was reserved
    blocks: tuple[BlockView, ...]
    present_pages: int
    capacity_miss_pages: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    pages: int
    blocks: tuple[BlockView, ...]
    lease_id: int
    note: str = ""


@dataclass(slots=True)
class _Lease:
    id: int
    kind: str  # "write" | "read"
    block_ids: list[int]
    deadline: float


# ----------------------------------------------------------------------------------- eviction policies
class LRU:
    """Least recently used (committed or read) first."""

    name = "lru"

    def priority(self, b: Block, now: float) -> float:
        return b.last_access


class ValuePerByte:
    """JointServe §3.2: avoided recovery per byte, ``p̂ · ĉ / s`` (lowest evicted first).

    ``ĉ``: recompute cost of the page, ``page_size · (1 + page_index · page_size / context_scale)``
    token-units (prefill of late tokens attends over more context), each token-unit weighted by the model's
    KV bytes per token: a model's prefill work per token grows with its KV width and layer count as its KV
    bytes do, so a model with wider KV is neither cheaper to recompute nor worth less per byte (pricing
    token-units per byte evicted the newest sessions of the model with the widest KV — 3x the bytes — before
    older ones of the others). ``s``: bytes held.

    ``p̂``, the reuse likelihood: ``(1 + hits) · S(age)``, ``age`` the time since the page was last read or
    written. ``S`` is the chance that a page idle this long is still going to be read: the survival
    ``P(gap > age)`` of the re-access gaps this store observes (``observe_gap``, fed by the registry: one gap
    per lookup of a stored chain, or per write of one not read since its last write, the idle time of its
    deepest stored page, which is the session's own tail, so the samples are sessions' return gaps, not the
    time between a call's restore and its own write), a log-normal fitted by ``talaria.return_prob.LogGapFit``.
    Until ``LogGapFit.min_samples`` gaps were seen, ``S = 2^(-age / half_life_s)``. A fixed half-life misjudged
    finished sessions: a session restored seven times and finished two minutes ago kept ``8 · 2^-2 = 2`` against
    a new session's first page at 1, so under capacity pressure the store evicted the live sessions' newest
    pages and kept the dead ones (their next call found 0 cached tokens). With the learned survival a page idle
    far past the observed gaps is worth ~0 whatever its hits; among such pages the least recently used goes
    first (a tiny ``2^(-age / half_life_s)`` term keeps the order).
    """

    name = "value_per_byte"

    def __init__(self, half_life_s: float = 60.0, context_scale: float = 8192.0, gaps: LogGapFit | None = None) -> None:
        self.half_life_s = half_life_s
        self.context_scale = context_scale
        self.gaps = gaps if gaps is not None else LogGapFit()

    def observe_gap(self, gap_s: float) -> None:
        """One observed re-access gap of a stored chain, seconds. Mutates ``gaps``."""
        self.gaps.observe(gap_s)

    def survival(self, age: float) -> float:
        """The reuse factor ``S(age)`` of a page idle for ``age`` seconds. Pure read."""
        prior = math.pow(2.0, -age / self.half_life_s)
        if not self.gaps.ready:
            return prior
        return self.gaps.survival(age) + 1e-9 * prior

    def priority(self, b: Block, now: float) -> float:
        ps = b.layout.page_size
        cost = ps * (1.0 + b.page_index * ps / self.context_scale)
        p = (1 + b.hits) * self.survival(max(0.0, now - b.last_access))
        bytes_per_token = b.layout.page_bytes / ps
        return p * cost * bytes_per_token / max(1, b.layout.page_bytes)


POLICIES: dict[str, Callable[[], object]] = {"lru": LRU, "value_per_byte": ValuePerByte}


@dataclass(slots=True)
class Counters:
    lookups: int = 0
    hit_pages: int = 0
    miss_pages: int = 0
    restores: int = 0
    capacity_miss_pages: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    stale_lookups: int = 0
    expired_leases: int = 0


class HostKVRegistry:
    def __init__(
        self,
        capacity_bytes: int,
        slab_bytes: int,
        *,
        clock: Callable[[], float],
        policy: object | None = None,
        default_lease_s: float = 30.0,
        max_lease_s: float = 600.0,
    ) -> None:
        if slab_bytes <= 0 or capacity_bytes < slab_bytes:
            raise ValueError(f"capacity {capacity_bytes} must hold at least one slab of {slab_bytes} bytes")
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity_bytes // slab_bytes
        self.capacity_bytes = self.num_slabs * slab_bytes
        self.policy = policy if policy is not None else LRU()
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        self._clock = clock
        self._free: list[int] = list(range(self.num_slabs))  # min-heap: lowest slab ids first
        self._blocks: dict[int, Block] = {}  # every live block (reserved, committed, or unindexed but pinned)
        self._index: dict[Key, Block] = {}  # committed + referenced: what lookups see
        self._pending: dict[Key, Block] = {}  # reserved, copy not complete
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self.counters = Counters()

    # ------------------------------------------------------------------ introspection
    @property
    def slabs_free(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.num_slabs - len(self._free)) * self.slab_bytes

    @property
    def num_entries(self) -> int:
        return len(self._index)

    @property
    def num_reserved(self) -> int:
        return len(self._pending)

    @property
    def num_pinned(self) -> int:
        return sum(1 for b in self._blocks.values() if b.pins > 0)

    def slabs_for(self, page_bytes: int) -> int:
        return -(-page_bytes // self.slab_bytes)

    def block(self, block_id: int) -> Block | None:
        return self._blocks.get(block_id)

    def visible(self, layout: Layout, prefix_hash: int) -> bool:
        b = self._index.get((layout.model, layout.tp_rank, prefix_hash))
        return b is not None and b.layout.shape_key() == layout.shape_key()

    # ------------------------------------------------------------------ write path
    def reserve(self, layout: Layout, hashes: Sequence[int], lease_s: float = 0.0) -> ReserveResult:
        """Reserve slabs for the pages of the chain ``hashes`` (from page 0) not held yet.

        Pages already committed (or being written by another lease) are skipped. If capacity runs out
        even after evicting unpinned leaves, the longest run of missing pages that fits is reserved and the
        rest counted as capacity misses (a page without its predecessors is useless). The new blocks are
        pinned by the returned write lease and invisible until ``commit``.
        """
        check_layout(layout, self.num_slabs * self.slab_bytes)
        now = self._clock()
        model, rank = layout.model, layout.tp_rank
        todo: list[int] = []  # page indices to reserve
        present = 0
        deepest_idle: float | None = None  # idle time of the chain's last stored page: a re-access gap
        for i, h in enumerate(hashes):
            key = (model, rank, h)
            held = self._index.get(key) or self._pending.get(key)
            if held is not None:
                if held.layout.shape_key() != layout.shape_key():
                    break  # same key, other layout: stale chain; do not extend it
                present += 1
                if held.state is BlockState.COMMITTED:
                    if not todo:
                        deepest_idle = None if held.read_last else now - held.last_access
                    held.last_access, held.read_last = now, False
                continue
            if todo and todo[-1] != i - 1:
                break  # a hole: pages after it would not be reachable from this chain anyway
            todo.append(i)
        if deepest_idle is not None:
            self._observe_gap(deepest_idle)
        per = self.slabs_for(layout.page_bytes)
        protect = {(model, rank, hashes[i]) for i in range(len(hashes))}
        if len(self._free) < per * len(todo):  # one eviction pass for every missing page (the heap is built once)
            self._evict(per * len(todo), protect, now)
        fit = min(len(todo), len(self._free) // per)  # the longest run that fits, evicting all that can go if not all
        missed = len(todo) - fit
        self.counters.capacity_miss_pages += missed
        todo = todo[:fit]
        if not todo:
            return ReserveResult(0, (), present, missed)
        lease = _Lease(next(self._lease_ids), "write", [], now + self._lease_len(lease_s))
        views = []
        for i in todo:
            key = (model, rank, hashes[i])
            parent = (model, rank, hashes[i - 1]) if i > 0 else None
            slabs = [heapq.heappop(self._free) for _ in range(per)]
            b = Block(next(self._ids), key, layout, parent, i, slabs, pins=1, created=now, last_access=now)
            self._blocks[b.id] = b
            self._pending[key] = b
            self._link(parent, +1)
            lease.block_ids.append(b.id)
            views.append(self._view(b))
        self._leases[lease.id] = lease
        return ReserveResult(lease.id, tuple(views), present, missed)

    def commit(
        self, lease_id: int, block_ids: Sequence[int], abort: bool = False, checksums: Sequence[int] = (), checksum_algo: str = "",
    ) -> tuple[int, int]:
        """The writer's copies of ``block_ids`` completed: publish them (or drop them with ``abort``).

        Returns ``(committed, aborted)``. Unknown ids (expired lease, other lease) are ignored.
        A committed block whose parent is missing from the index stays unreachable and is freed.
        ``checksums``: one per ``block_ids`` entry, or empty; recorded with each block and returned
        by lookups, so a reader can verify the bytes it received. Raises ValueError on a length mismatch.
        """
        if checksums and len(checksums) != len(block_ids):
            raise ValueError(f"{len(checksums)} checksums for {len(block_ids)} block ids")
        sums = dict(zip(block_ids, checksums))
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind != "write":
            return 0, 0
        now = self._clock()
        ids = set(block_ids)
        committed = aborted = 0
        # commit in chain order so a parent is indexed before its children
        for bid in sorted((b for b in lease.block_ids if b in ids), key=lambda b: self._blocks[b].page_index):
            b = self._blocks[bid]
            lease.block_ids.remove(bid)
            del self._pending[b.key]
            if abort or (b.parent is not None and b.parent not in self._index):
                self._link(b.parent, -1)
                b.pins -= 1
                self._maybe_free(b)
                aborted += 1
                continue
            b.state = BlockState.COMMITTED
            if bid in sums:
                b.checksum, b.checksum_algo = sums[bid], checksum_algo
            b.refs += 1
            b.last_access = now
            b.pins -= 1
            self._index[b.key] = b
            self.counters.bytes_in += b.layout.page_bytes
            committed += 1
        if not lease.block_ids:
            del self._leases[lease_id]
        return committed, aborted

    # ------------------------------------------------------------------ read path
    def agreed_pages(self, layout: Layout, hashes: Sequence[int]) -> tuple[int, str]:
        """Pages of ``hashes`` committed, with ``layout``, by every TP rank (Appendix B), and why it stops."""
        model, rank, shape = layout.model, layout.tp_rank, layout.shape_key()
        for i, h in enumerate(hashes):
            own = self._index.get((model, rank, h))
            if own is None:
                return i, "miss"
            if own.layout.shape_key() != shape:
                return i, "layout_mismatch"
            for r in range(layout.tp_size):
                b = self._index.get((model, r, h)) if r != rank else own
                if b is None or b.layout.shape_key() != shape:
                    return i, "tp_disagreement"
        return len(hashes), ""

    def lookup(self, layout: Layout, hashes: Sequence[int], pin: bool = False, lease_s: float = 0.0) -> LookupResult:
        """Longest restorable prefix of ``hashes`` for this rank; with ``pin`` its blocks are pinned under a
        read lease (release with ``unpin``)."""
        check_layout(layout, self.num_slabs * self.slab_bytes)
        now = self._clock()
        n, note = self.agreed_pages(layout, hashes)
        c = self.counters
        c.lookups += 1
        c.hit_pages += n
        c.miss_pages += len(hashes) - n
        if note == "layout_mismatch":
            c.stale_lookups += 1
        blocks = [self._index[(layout.model, layout.tp_rank, h)] for h in hashes[:n]]
        if blocks:
            self._observe_gap(now - blocks[-1].last_access)
        for b in blocks:
            b.last_access, b.read_last = now, True
            b.hits += 1
        lease_id = 0
        if pin and blocks:
            lease_id = self._pin(blocks, "read", lease_s, now)
        return LookupResult(n, tuple(self._view(b) for b in blocks), lease_id, note)

    def pin(self, block_ids: Sequence[int], lease_s: float = 0.0) -> tuple[int, int]:
        """Pin existing committed blocks under a new read lease. Returns ``(lease_id, pinned)``."""
        blocks = [b for b in (self._blocks.get(i) for i in block_ids) if b is not None and b.state is BlockState.COMMITTED]
        if not blocks:
            return 0, 0
        return self._pin(blocks, "read", lease_s, self._clock()), len(blocks)

    def unpin(self, lease_id: int, read_complete: bool = False) -> int:
        """End a read lease (``read_complete``: its pages were restored) or abort a write lease."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        if lease.kind == "write":
            return self.commit(lease_id, list(lease.block_ids), abort=True)[1]
        del self._leases[lease_id]
        if read_complete:
            self.counters.restores += 1
        for bid in lease.block_ids:
            b = self._blocks[bid]
            b.pins -= 1
            if read_complete:
                self.counters.bytes_out += b.layout.page_bytes
            self._maybe_free(b)
        return len(lease.block_ids)

    # ------------------------------------------------------------------ reclamation
    def release(self, model: str, tp_rank: int, hashes: Sequence[int] = (), all_of_model: bool = False) -> int:
        """Drop the index references of the named blocks and everything that extends them (or of the whole
        model/rank). Returns blocks unindexed; pinned ones are freed when unpinned."""
        if all_of_model:
            victims = [b for k, b in self._index.items() if k[0] == model and k[1] == tp_rank]
        else:
            roots = {(model, tp_rank, h) for h in hashes}
            victims = [b for k, b in self._index.items() if k in roots]
            # descendants: walk until no new block is found (chains are short-lived dict walks)
            found = {b.key for b in victims}
            grew = True
            while grew:
                grew = False
                for k, b in self._index.items():
                    if k not in found and b.parent in found:
                        found.add(k)
                        victims.append(b)
                        grew = True
        for b in sorted(victims, key=lambda b: -b.page_index):
            self._unindex(b)
        return len(victims)

    def release_leaves(self, model: str, tp_rank: int, hashes: Sequence[int]) -> int:
        """A session ended: ``hashes`` is one chain, page 0 first. Unindex its pages from the last
        backwards while each is an indexed leaf (no other chain extends it), so prefixes other sessions share
        stay. Pinned pages are freed on unpin. Returns blocks unindexed."""
        n = 0
        for h in reversed(list(hashes)):
            b = self._index.get((model, tp_rank, h))
            if b is None:
                continue  # never stored (or evicted already): look further back
            if b.children:
                break
            self._unindex(b)
            n += 1
        return n

    def expire(self) -> int:
        """End every lease past its deadline (abort writes, drop read pins). Returns leases ended."""
        now = self._clock()
        dead = [lid for lid, l in self._leases.items() if l.deadline <= now]
        for lid in dead:
            self.unpin(lid, read_complete=False)
        self.counters.expired_leases += len(dead)
        return len(dead)

    def _evict(self, need_slabs: int, protect: set[Key], now: float) -> bool:
        """Unindex unpinned leaves (policy order) until ``need_slabs`` slabs are free."""
        prio = self.policy.priority  # type: ignore[attr-defined]
        heap = [(prio(b, now), b.id) for k, b in self._index.items() if self._evictable(b, protect)]
        heapq.heapify(heap)
        while len(self._free) < need_slabs and heap:
            _, bid = heapq.heappop(heap)
            b = self._blocks.get(bid)
            if b is None or b.key not in self._index or not self._evictable(b, protect):
                continue
            parent = self._index.get(b.parent) if b.parent is not None else None
            self._unindex(b)
            self.counters.evictions += 1
            if parent is not None and self._evictable(parent, protect):
                heapq.heappush(heap, (prio(parent, now), parent.id))
        return len(self._free) >= need_slabs

    @staticmethod
    def _evictable(b: Block, protect: set[Key]) -> bool:
        return b.children == 0 and b.pins == 0 and b.key not in protect

    def _unindex(self, b: Block) -> None:
        if self._index.get(b.key) is b:
            del self._index[b.key]
            b.refs -= 1
            self._link(b.parent, -1)
            self._maybe_free(b)

    def _maybe_free(self, b: Block) -> None:
        """Return the slabs when neither a reference nor a pin remains (lifetime separation)."""
        if b.refs == 0 and b.pins == 0 and b.id in self._blocks:
            del self._blocks[b.id]
            for s in b.slabs:
                heapq.heappush(self._free, s)
            b.slabs = []

    def _link(self, parent: Key | None, delta: int) -> None:
        if parent is None:
            return
        p = self._index.get(parent) or self._pending.get(parent)
        if p is not None:
            p.children += delta

    # ------------------------------------------------------------------ helpers
    def _observe_gap(self, gap_s: float) -> None:
        """Tell a policy that learns from re-access gaps (``ValuePerByte.observe_gap``) one of them."""
        observe = getattr(self.policy, "observe_gap", None)
        if observe is not None:
            observe(gap_s)

    def _lease_len(self, lease_s: float) -> float:
        if lease_s <= 0:
            return self.default_lease_s
        return min(lease_s, self.max_lease_s)

    def _pin(self, blocks: list[Block], kind: str, lease_s: float, now: float) -> int:
        lease = _Lease(next(self._lease_ids), kind, [b.id for b in blocks], now + self._lease_len(lease_s))
        for b in blocks:
            b.pins += 1
        self._leases[lease.id] = lease
        return lease.id

    def _view(self, b: Block) -> BlockView:
        S = self.slab_bytes
        extents: list[Extent] = []
        left = b.layout.page_bytes
        run_start, run_len = b.slabs[0], 0
        for j, s in enumerate(b.slabs):
            if j and s != run_start + run_len:
                extents.append(Extent(run_start * S, run_len * S))
                run_start, run_len = s, 0
            run_len += 1
        extents.append(Extent(run_start * S, run_len * S))
        # the last extent ends where the page's bytes end
        out, total = [], 0
        for e in extents:
            n = min(e.length, left - total)
            out.append(Extent(e.offset, n))
            total += n
        return BlockView(b.id, b.hash, b.page_index, tuple(out), b.checksum, b.checksum_algo)

    def check_integrity(self) -> None:
        """Every slab is free or owned by exactly one live block; counts agree with the leases."""
        owner: dict[int, int] = {}
        for b in self._blocks.values():
            for s in b.slabs:
                assert s not in owner, f"slab {s} owned twice"
                owner[s] = b.id
        free = set(self._free)
        assert len(free) == len(self._free), "slab freed twice"
        assert not (free & owner.keys()), "a free slab is owned"
        assert len(free) + len(owner) == self.num_slabs, "slab leak"
        pins: dict[int, int] = {}
        for l in self._leases.values():
            for bid in l.block_ids:
                pins[bid] = pins.get(bid, 0) + 1
        for b in self._blocks.values():
            want_pins = pins.get(b.id, 0)
            assert b.pins == want_pins, f"block {b.id}: {b.pins} pins, leases say {want_pins}"
            indexed = self._index.get(b.key) is b
            assert b.refs == (1 if indexed else 0), f"block {b.id}: refs {b.refs}, indexed {indexed}"
            if b.state is BlockState.RESERVED:
                assert self._pending.get(b.key) is b and not indexed, f"reserved block {b.id} visible"
            assert indexed or b.pins > 0 or self._pending.get(b.key) is b, f"block {b.id} leaked"
        for k, b in [*self._index.items(), *self._pending.items()]:
            kids = sum(1 for c in [*self._index.values(), *self._pending.values()] if c.parent == k)
            assert b.children == kids, f"block {b.id}: children {b.children}, found {kids}"


__all__ = [
    "Block", "BlockState", "BlockView", "Counters", "Extent", "Family", "HostKVRegistry", "LRU", "Layout",
    "LayoutError", "LookupResult", "POLICIES", "ReserveResult", "ValuePerByte", "check_layout",
]
