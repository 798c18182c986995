"""Block manager: the one object the scheduler asks about KV pages (pure Python, no torch).

Design: it composes the page allocator, the radix prefix cache (full pages keyed by cumulative page hash,
Talaria §4.3) and the session cache (committed tokens incl. the partial last page) and offers
check-then-commit pairs to the scheduler:

* ``match_prefix`` (read-only apart from LRU touches) finds the reusable prefix of a sequence: the longer of
  the session entry's common prefix and the radix match, capped at ``len(tokens) - 1`` so that at least the
  last prompt token is recomputed (its logits are needed). ``pages_needed`` says how many fresh pages an
  admission costs, ``ensure_free`` evicts cache entries (radix leaves LRU first, then session entries LRU)
  while protecting the match, and ``admit`` commits: references on reused pages, a lock on the radix path,
  consumption of the session entry, fresh pages for the rest.
* Copy-on-write: a request never writes into a page it shares with the radix cache, a session entry or
  another request. When the reused prefix ends inside a page that is shared, ``admit`` allocates a fresh
  page and emits a :class:`CopyOp` (copy the first ``num_rows`` KV rows); the executor performs the copies
  before the step's forward. The source page keeps an extra reference until ``finish_copies`` (called at
  the start of the next schedule), so it cannot be recycled before it is read.
* ``publish`` inserts a running sequence's computed full pages into the radix cache as its prefill goes
  (the scheduler calls it while calls wait, once the executor said the last forward completed), so calls that share a prefix with a call still being
  prefilled reuse it instead of computing it again.
* ``can_append``/``append`` give a decoding sequence its next page; ``release`` ends a sequence: full
  computed pages go into the radix cache, and with a session id the committed tokens + pages become the
  session entry (the references pass to it); everything else is dereferenced.
* Host restores (the manager owns every page, the host tier only moves bytes): ``match_prefix``
  with a :class:`HostIndex` port also says how many further full pages the host store may hold
  (``PrefixMatch.host_pages``); ``reserve_restore`` holds the device part of the prefix and allocates
  fresh pages for the restore (evicting caches if needed), ``adopt_restore`` publishes the first ``n``
  restored pages into the radix cache and keeps the path locked for the waiting sequence until its
  admission (``release_hold``), ``cancel_restore`` gives everything back. A reservation in progress holds
  its pages: nothing can evict or recycle them while the bytes are being copied in off the executor thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from talaria.hashing import page_hashes

from services.engine.kv.allocator import PageAllocator
from services.engine.kv.radix import RadixCache
from services.engine.kv.session_cache import SessionCache, SessionEntry, common_prefix_len
from services.engine.kv.session_residency import KvLocation

if TYPE_CHECKING:
    from services.engine.kv.retention import RetentionBook


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy KV rows ``[0, num_rows)`` of page ``src`` into page ``dst`` (all layers)."""

    src: int
    dst: int
    num_rows: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    num_tokens: int  # tokens whose KV is reused (always < len(tokens) when tokens is non-empty)
    pages: tuple[int, ...]  # ceil(num_tokens / page_size) pages holding them
    radix_hashes: tuple[int, ...] = ()  # radix path to lock (radix source only)
    from_session: bool = False
    needs_copy: bool = False  # the last reused page is partial and shared: copy-on-write
    device_pages: int = 0  # full pages of the prompt on the device (radix or session entry; not capped)
    host_pages: int = 0  # further full pages the host store may hold (HostIndex; an upper bound)

    @property
    def source(self) -> str:
        return "session" if self.from_session else ("radix" if self.pages else "none")


@dataclass(slots=True)
class Allocation:
    """What ``admit`` committed for one sequence."""

    pages: list[int]  # page table covering the requested token count
    locked_hashes: list[int]  # radix path the sequence must unlock on release
    num_cached_tokens: int
    copies: list[CopyOp] = field(default_factory=list)


class HostIndex(Protocol):
    """The host tier's in-memory knowledge of what the store holds (a port: pure, no I/O, any thread)."""

    def restorable_pages(self, hashes: Sequence[int], start: int, session_id: str) -> int:
        """How many of ``hashes[start:]`` the store may hold (an upper bound; its lookup is the truth)."""

    def session_tokens(self, session_id: str) -> int:
        """Tokens of ``session_id`` checkpointed into the store (0: none known)."""


@dataclass(frozen=True, slots=True)
class RestoreReservation:
    """Pages held for one host restore (``reserve_restore``): ``chain`` = the device pages of the first
    ``len(chain)`` full pages (a reference each), ``pages`` = fresh pages the next ``len(pages)`` full pages
    are restored into. ``hashes`` covers both."""

    rid: int
    hashes: tuple[int, ...]
    chain: tuple[int, ...]
    pages: tuple[int, ...]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        salt: int = 0,
        clock: Callable[[], float],
        session_entries: int = 256,
        session_max_pages: int | None = None,
        allocator: PageAllocator | None = None,
    ) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        if allocator is not None and allocator.num_pages != num_pages:
            raise ValueError(f"allocator has {allocator.num_pages} pages, expected {num_pages}")
        self.page_size = page_size
        self.salt = salt
        # an injected allocator (e.g. the cold pool's staging-aware one) must start empty
        self.allocator = allocator if allocator is not None else PageAllocator(num_pages)
        self.radix = RadixCache(self.allocator, clock)
        self.sessions = SessionCache(self.allocator, clock, session_entries, session_max_pages)
        self._pending_copy_src: list[int] = []
        # transfer pins (device -> host checkpoint copies in flight): page -> pin count. Counted apart from
        # cache/sequence references (Talaria Appendix B, lifetime separation): a pinned page is never
        # recycled, whoever else lets go of it.
        self._transfer_pins: dict[int, int] = {}
        self._restores: dict[int, RestoreReservation] = {}  # host restores in progress (their pages are held)
        # write-back port (kv/write_back.py): called when evicting every cache entry could not free enough
        # pages; a host tier writes back the dirty pages only its pins hold, returns the pins, says pages freed
        self.pressure_hook: Callable[[], int] | None = None
        self._next_restore = 0

        # prefix statistics (prompt tokens seen at admission / served from a cache)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ---------------------------------------------------------------- hashing
    def extend_hashes(self, hashes: list[int], token_ids: Sequence[int], salt: int | None = None) -> list[int]:
        """Extend ``hashes`` in place to cover every full page of ``token_ids`` (tokens only ever append).
        ``salt`` starts the chain (a tenant's, ``talaria.hashing.tenant_salt``); None = the model salt."""
        n_full = len(token_ids) // self.page_size
        if len(hashes) < n_full:
            prev = hashes[-1] if hashes else None
            s = self.salt if salt is None else salt
            hashes.extend(page_hashes(token_ids, self.page_size, s, start=len(hashes), prev=prev))
        return hashes

    # ---------------------------------------------------------------- admission
    def match_prefix(self, token_ids: Sequence[int], hashes: Sequence[int], session_id: str = "", host: HostIndex | None = None) -> PrefixMatch:
        """Longest reusable prefix of ``token_ids`` (``hashes`` = its full-page hashes); with ``host``, also
        how many further full pages the host store may hold (``host_pages``).

        Mutates nothing except LRU access times of matched radix nodes.
        """
        P = self.page_size
        cap = max(len(token_ids) - 1, 0)
        radix_pages = self.radix.match(hashes)
        radix_n = len(radix_pages) * P
        entry = self.sessions.peek(session_id) if session_id else None
        sess_n = common_prefix_len(list(token_ids), entry.token_ids) if entry is not None else 0
        device = max(len(radix_pages), min(sess_n // P, len(entry.pages)) if entry is not None else 0)
        n_full = len(token_ids) // P
        host_n = host.restorable_pages(hashes[:n_full], device, session_id) if host is not None and device < n_full else 0
        if entry is not None and sess_n > 0 and sess_n >= radix_n:
            n = min(sess_n, cap)
            pages = tuple(entry.pages[: cdiv(n, P)])
            shared = bool(pages) and self.allocator.refcount(pages[-1]) > 1
            return PrefixMatch(n, pages, (), True, n % P != 0 and shared, device, host_n)
        n = min(radix_n, cap)
        k = cdiv(n, P)
        return PrefixMatch(n, tuple(radix_pages[:k]), tuple(hashes[:k]), False, n % P != 0, device, host_n)

    def session_prefix(self, session_id: str, token_ids: Sequence[int], host: HostIndex | None = None, device: bool = True) -> tuple[KvLocation, int]:
        """Where the reusable prefix of a session's next prompt is, and how long: ``(DEVICE, n)`` from the
        session cache (when ``device``), else ``(HOST, n)`` from the host index, else ``(MISSING, 0)``.
        Read-only (the slot scheduler's view asks this for every queued call)."""
        if device:
            entry = self.sessions.peek(session_id)
            if entry is not None:
                return KvLocation.DEVICE, common_prefix_len(entry.token_ids, list(token_ids))
        n = host.session_tokens(session_id) if host is not None else 0
        return (KvLocation.HOST, min(n, len(token_ids))) if n > 0 else (KvLocation.MISSING, 0)

    # ---------------------------------------------------------------- host restores
    def reserve_restore(self, token_ids: Sequence[int], hashes: Sequence[int], session_id: str, k: int) -> RestoreReservation | None:
        """Hold the device part of the prefix and allocate up to ``k`` fresh pages for the next full pages
        (``hashes`` = the full-page hashes the source can provide, a prefix of the prompt's), evicting other
        cache entries if needed.

        Mutates: allocator references (one per held and fresh page), the caches (eviction). Returns None
        when nothing beyond the device prefix can be restored (no pages, or the device already holds it)."""
        P = self.page_size
        radix_pages = self.radix.match(hashes)
        entry = self.sessions.peek(session_id) if session_id else None
        chain = list(radix_pages)
        if entry is not None:
            sess_full = min(common_prefix_len(list(token_ids), entry.token_ids) // P, len(entry.pages), len(hashes))
            if sess_full > len(chain):
                chain += entry.pages[len(chain) : sess_full]
        k = min(k, len(hashes) - len(chain))
        if k <= 0:
            return None
        self.allocator.incref(chain)  # held until adopt/cancel: evictions cannot recycle them
        if not self.can_allocate(k):
            locked = list(hashes[: len(radix_pages)])
            self.radix.lock(locked)
            try:
                self.ensure_free(k, None, session_id)
            finally:
                self.radix.unlock(locked)
            k = min(k, self.num_free_pages)
        if k <= 0:
            self.allocator.decref(chain)
            return None
        self._next_restore += 1
        res = RestoreReservation(self._next_restore, tuple(hashes[: len(chain) + k]), tuple(chain), tuple(self.allocator.allocate(k)))
        self._restores[res.rid] = res
        return res

    def adopt_restore(self, res: RestoreReservation, n: int) -> list[int]:
        """Publish the first ``n`` restored pages (their bytes are in place) into the radix cache, after the
        held device chain; drop the rest. Returns the radix path, locked for the waiting sequence until
        ``release_hold`` (its admission or end). Mutates: radix cache, allocator references, the reservation."""
        del self._restores[res.rid]
        n = max(0, min(n, len(res.pages)))
        hashes = list(res.hashes[: len(res.chain) + n])
        self.radix.insert(hashes, [*res.chain, *res.pages[:n]])
        self.radix.lock(hashes)
        self.allocator.decref([*res.chain, *res.pages])  # the radix cache holds them now (or they are freed)
        return hashes

    def cancel_restore(self, res: RestoreReservation) -> None:
        """Give back a reservation whose restore failed or was declined. Mutates: allocator references."""
        del self._restores[res.rid]
        self.allocator.decref([*res.chain, *res.pages])

    def release_hold(self, hashes: Sequence[int]) -> None:
        """Unlock a radix path returned by ``adopt_restore``."""
        self.radix.unlock(hashes)

    @property
    def num_restoring_pages(self) -> int:
        return sum(len(r.pages) for r in self._restores.values())

    def pages_needed(self, match: PrefixMatch, num_tokens: int) -> int:
        """Fresh pages ``admit(match, num_tokens)`` will allocate."""
        return cdiv(num_tokens, self.page_size) - len(match.pages) + (1 if match.needs_copy else 0)

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    def ensure_free(self, n: int, protect: PrefixMatch | None = None, protect_session: str = "") -> bool:
        """Evict cache entries until ``n`` pages are free: unlocked radix leaves LRU first, then session
        entries LRU, then (``pressure_hook``) pages only a host write-back's pins held, once written back.
        The match ``protect`` (its radix path / the session ``protect_session``) is kept.
        Returns whether ``n`` pages are now free (the caches may have shrunk even when not)."""
        if self.allocator.num_free >= n:
            return True
        locked = list(protect.radix_hashes) if protect is not None else []
        self.radix.lock(locked)
        try:
            while self.allocator.num_free < n:
                evicted, _ = self.radix.evict(n - self.allocator.num_free)
                if evicted:
                    continue
                if self.sessions.num_evictable(protect_session):
                    self.sessions.evict_lru(protect_session)
                    continue
                if self.pressure_hook is not None and self.pressure_hook():
                    continue  # dirty pages written back and unpinned (host write-back)
                return False
            return True
        finally:
            self.radix.unlock(locked)

    def admit(self, match: PrefixMatch, num_tokens: int, session_id: str = "", num_prompt_tokens: int | None = None) -> Allocation:
        """Commit an admission: pages for ``num_tokens`` tokens of which ``match.num_tokens`` are reused.

        Consumes the session entry of ``session_id`` (if any): pages of a session match pass to the
        sequence, the rest are released. Radix pages get a sequence reference and their path is locked.
        Caller must have checked ``can_allocate(pages_needed(match, num_tokens))``.
        """
        P = self.page_size
        need = self.pages_needed(match, num_tokens)
        if not self.allocator.can_allocate(need):
            raise RuntimeError(f"admit needs {need} pages, {self.allocator.num_free} free (check first)")
        pages = list(match.pages)
        locked: list[int] = []
        entry = self.sessions.take(session_id) if session_id else None
        if match.from_session:
            assert entry is not None and list(entry.pages[: len(pages)]) == pages, "stale session match"
            self.allocator.decref(entry.pages[len(pages) :])
        else:
            if entry is not None:
                self.allocator.decref(entry.pages)
            self.allocator.incref(pages)
            self.radix.lock(match.radix_hashes)
            locked = list(match.radix_hashes)
        copies: list[CopyOp] = []
        if match.needs_copy:
            (dst,) = self.allocator.allocate(1)
            src = pages[-1]
            copies.append(CopyOp(src, dst, match.num_tokens % P))
            self._pending_copy_src.append(src)  # our reference moves to the pending list
            pages[-1] = dst
        pages += self.allocator.allocate(cdiv(num_tokens, P) - len(pages))
        prompt_n = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        self.num_queried_tokens += prompt_n
        self.num_hit_tokens += min(match.num_tokens, prompt_n)
        return Allocation(pages, locked, match.num_tokens, copies)

    def finish_copies(self) -> None:
        """The executor has performed every emitted CopyOp: drop the references kept on their sources."""
        if self._pending_copy_src:
            self.allocator.decref(self._pending_copy_src)
            self._pending_copy_src = []

    # ---------------------------------------------------------------- decode
    def needs_page(self, num_pages: int, num_tokens: int) -> bool:
        return num_tokens > num_pages * self.page_size

    def can_append(self, num_pages: int, num_tokens: int) -> bool:
        return not self.needs_page(num_pages, num_tokens) or self.allocator.can_allocate(1)

    def append(self, pages: list[int], num_tokens: int) -> None:
        """Grow ``pages`` in place to cover ``num_tokens`` tokens (at most one new page)."""
        if self.needs_page(len(pages), num_tokens):
            pages += self.allocator.allocate(1)

    # ---------------------------------------------------------------- release
    def release(
        self,
        pages: list[int],
        locked_hashes: Sequence[int],
        token_ids: Sequence[int] = (),
        num_computed: int = 0,
        hashes: list[int] | None = None,
        session_id: str = "",
        cache: bool = True,
        salt: int | None = None,
    ) -> None:
        """Give up a sequence's pages (the list is not modified).

        With ``cache``: the full pages among the first ``num_computed`` tokens are inserted into the radix
        cache, and with ``session_id`` the committed tokens and their pages become the session entry (the
        sequence's references pass to it). All other references are dropped; the radix path is unlocked.
        """
        P = self.page_size
        keep = cdiv(num_computed, P) if cache else 0
        if cache and num_computed >= P:
            committed = token_ids[:num_computed]
            hs = self.extend_hashes(hashes if hashes is not None else [], committed, salt)[: num_computed // P]
            self.radix.insert(hs, pages[: len(hs)])
        if cache and session_id and keep:
            self.allocator.decref(pages[keep:])
            self.sessions.put(session_id, list(token_ids[:num_computed]), pages[:keep])
        else:
            self.allocator.decref(pages)
        self.radix.unlock(locked_hashes)

    def publish(self, hashes: Sequence[int], pages: Sequence[int], n: int) -> None:
        """A running sequence's first ``n`` full pages hold computed KV (a completed forward wrote them): insert the chain
        into the radix cache now, not at its end, so calls sharing the prefix reuse it while it still runs.
        The sequence keeps its own references and never writes into a full computed page again, so the
        pages are as immutable as any cached page. Nodes already present keep their page. Mutates: the radix
        cache (new nodes take a reference on their page)."""
        if n > 0:
            self.radix.insert(hashes[:n], pages[:n])

    def pin_pages(self, pages: Sequence[int]) -> None:
        """Take a transfer pin (one allocator reference) on each page until ``unpin_pages``."""
        self.allocator.incref(pages)
        for p in pages:
            self._transfer_pins[p] = self._transfer_pins.get(p, 0) + 1

    def unpin_pages(self, pages: Sequence[int]) -> int:
        """Drop transfer pins taken by ``pin_pages``. Returns pages freed."""
        for p in pages:
            n = self._transfer_pins[p] - 1
            if n:
                self._transfer_pins[p] = n
            else:
                del self._transfer_pins[p]
        return self.allocator.decref(pages)

    def pin_count(self, page: int) -> int:
        """Transfer pins on ``page``."""
        return self._transfer_pins.get(page, 0)

    @property
    def num_transfer_pins(self) -> int:
        return sum(self._transfer_pins.values())

    def flush(self) -> int:
        """Drop every unlocked radix node and every session entry. Returns pages freed."""
        return self.sessions.clear() + self.radix.clear()

    # ---------------------------------------------------------------- session entries
    def session_tokens(self, session_id: str) -> list[int] | None:
        """The committed tokens of the session's device entry (the cache's own list: read, never mutate), or
        None when the device holds none. Mutates nothing (not even LRU order)."""
        e = self.sessions.peek(session_id)
        return e.token_ids if e is not None else None

    def session_entries(self) -> list[SessionEntry]:
        """The session cache's entries, least recently used first (a new list of the live entries: read them,
        never mutate them). For the residency planner's candidates."""
        return self.sessions.entries()

    def drop_session_entry(self, session_id: str) -> bool:
        """Release the session's device entry (its full pages stay in the radix cache while referenced there;
        a host copy, if any, stays in the store). Returns whether the device holds no entry of it now.
        Mutates: the session cache, allocator references."""
        self.sessions.drop(session_id)
        return session_id not in self.sessions

    @property
    def retention(self) -> RetentionBook | None:
        """The retention book ordering session-entry eviction by predicted return (None: plain LRU)."""
        return self.sessions.retention

    @retention.setter
    def retention(self, book: RetentionBook | None) -> None:
        self.sessions.retention = book

    def drop_session(self, session_id: str, chains: Sequence[Sequence[int]]) -> int:
        """A session ended: drop its session entry and, per hash chain it left (newest first), the
        radix leaves nothing else extends (shared prefixes and locked paths stay). Returns pages freed.
        Mutates: the session cache, the radix cache, allocator references."""
        return self.sessions.drop(session_id) + sum(self.radix.drop_leaves(c) for c in chains)

    # ---------------------------------------------------------------- introspection
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_radix_pages(self) -> int:
        """Pages the radix prefix cache holds."""
        return self.radix.num_pages

    @property
    def num_session_pages(self) -> int:
        """Page references the session cache's entries hold."""
        return self.sessions.num_pages

    def is_page_used(self, page: int) -> bool:
        """Whether ``page`` has a reference (the staging area's integrity check asks it)."""
        return self.allocator.refcount(page) > 0

    def only_pinned(self, page: int) -> bool:
        """Whether every reference on ``page`` is a transfer pin (no cache entry or sequence holds it): a
        write-back must copy it before its pins go, and then it is freed."""
        return self.allocator.refcount(page) == self._transfer_pins.get(page, 0)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def check_integrity(self, seq_pages: Sequence[Sequence[int]] = ()) -> None:
        """With the page tables of all live sequences, check every page reference is accounted for."""
        holders: dict[int, int] = {}
        for p in [*self.radix.pages(), *(p for e in self.sessions.entries() for p in e.pages), *self._pending_copy_src]:
            holders[p] = holders.get(p, 0) + 1
        for p, n in self._transfer_pins.items():
            holders[p] = holders.get(p, 0) + n
        for r in self._restores.values():
            for p in (*r.chain, *r.pages):
                holders[p] = holders.get(p, 0) + 1
        for table in seq_pages:

            for p in table:
                holders[p] = holders.get(p, 0) + 1
        self.allocator.check_integrity(holders)
        self.radix.check_integrity()
        self.sessions.check_integrity(self.page_size)
