"""Host KV write-back: which sessions' device pages are not in the kvstore yet.

Design note (SGLang HiCache's ``write_policy`` -- write_through copies every new node to host at once,
write_back only when the node is evicted from the device; the CPU-cache write-back of any textbook: a dirty
line is written when it is replaced, never lost). Talaria wrote every ended session call's full pages to the
host store at once ("write-through"): measured, that is ~10 ms of engine CPU per call (64% the Mooncake TCP
write, 16% the device->staging gather, 10% crc32, 8% the store's RPCs), paid even when the session comes back
to the same device a second later. Under write-back an ended call's full pages get a *transfer pin* (the
block manager's, so no eviction can recycle them) and the session is marked dirty here -- no copy. The copy
happens when the pages are about to leave the device:

* eviction: the KV manager, when evicting every cache entry could not free enough pages, asks the host tier
  (``KVManager.pressure_hook`` -> ``HostKV.relieve_pressure``) to write back the dirty sessions whose pages
  only their pins still hold, waits for the gathers, and the pins go; a dirty page is never freed unwritten;
* a cold engine's switch away from the model: the switch barrier (``HostKV.release_device``) writes back every dirty
  session first, and the slot scheduler's final drain phase (Dfin) starts it early (``cold/slotted.py``);
* a retention hint predicting the return after the lease window (``kv/retention.py`` value -1): at once;
* a cold engine whose other models have queued calls (``HostKV.leaving_soon``, set by ``cold/engine.py``): the
  next switch takes the pages off the device and the session's return comes after it, so the call's pages
  are written at once, as under write-through (the switch barrier would otherwise wait for them);
* a session end drops its dirty state without writing (``HostKV.release_session``).

A session has at most one dirty chain, its newest: marking a new one replaces (and unpins) the old one, which
the new call's pages extend or supersede. The kvstore never holds a partial chain: a write-back is the same
job a write-through checkpoint was (``Reserve`` -> gather -> Mooncake write -> ``Commit``; the store publishes
only committed pages). An engine restart or crash loses dirty state: the store was only ever a cache, the
next call recomputes.

Pure (no I/O, no torch); executor thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.engine.kv.retention import RetentionBook

WRITE_POLICIES = ("back", "through")


class DirtySet:
    """Dirty session chains, one per session, oldest first. Entries are opaque jobs with ``pages``."""

    def __init__(self) -> None:
        self._jobs: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._jobs

    def sessions(self) -> list[str]:
        return list(self._jobs)

    def items(self) -> list[tuple[str, Any]]:
        return list(self._jobs.items())

    @property
    def num_pages(self) -> int:
        return sum(len(j.pages) for j in self._jobs.values())

    def mark(self, session_id: str, job: Any) -> Any | None:
        """Make ``job`` the session's dirty chain (newest last). Returns the replaced job (its pins are the
        caller's to return), or None. Mutates the set."""
        old = self._jobs.pop(session_id, None)
        self._jobs[session_id] = job
        return old

    def take(self, session_ids: Iterable[str] | None = None) -> list[Any]:
        """Remove and return the dirty jobs of ``session_ids`` (all when None), oldest first. Mutates the set."""
        if session_ids is None:
            out, self._jobs = list(self._jobs.values()), {}
            return out
        return [j for sid in session_ids if (j := self._jobs.pop(sid, None)) is not None]


def write_now(policy: str, leaving_soon: Callable[[], bool] | None) -> bool:
    """At a call's end: copy its pages to the store now (write-through, or write-back on a cold engine whose
    next switch takes them off the device: ``leaving_soon()``, asked only under write-back) rather than
    marking the session dirty. Pure."""
    return policy == "through" or (leaving_soon is not None and leaving_soon())


def orphaned_sessions(dirty: DirtySet, only_pinned: Callable[[int], bool]) -> list[str]:
    """Eviction trigger: the dirty sessions with a page that only transfer pins still hold (every cache entry
    and sequence let go of it, ``KVManager.only_pinned``): writing them back is what frees memory now. Pure."""
    return [sid for sid, job in dirty.items() if any(only_pinned(p) for p in job.pages)]


def late_sessions(dirty: DirtySet, book: RetentionBook, now: float) -> list[str]:
    """Retention trigger: the dirty sessions whose hint expects their return after the lease window
    (``RetentionBook.value`` -1), so their pages may leave the device. Pure (reads the book)."""
    return [sid for sid in dirty.sessions() if book.value(sid, now) < 0]
