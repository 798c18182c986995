"""Paged KV bookkeeping of one engine instance (pure Python, no torch).

Layers, lowest first; a layer never imports the ones above it:

=====================  ======================================================================
``allocator``          which pages are free; a reference count per page
``radix``              prefix cache of full pages keyed by cumulative page hash (what to keep/evict)
``session_cache``      per-session committed tokens + pages (incl. the partial last page)
``session_residency``  where each session's KV is (``KvLocation`` device | host | missing): the one
                       owner of that answer (it reads the manager's caches; imports nothing above
                       at run time)
``manager``            the block manager the scheduler talks to: prefix match, admission, append,
                       release, eviction across the two caches, copy-on-write decisions, host
                       restores (reserve / adopt / cancel: the pages a restore writes are its)
``host_tier``          pure host-store policy and bookkeeping: restore-or-recompute, the host index
``write_back``         the host tier's dirty set and write-back triggers (pure choices)
``port``               ``KvPort``: all a host tier receives from its engine (manager, pool, prefill cost)
=====================  ======================================================================

The physical pool (tensors) belongs to the executor; these modules only hand out page ids. Nothing outside
this package reads the allocator, the radix cache or the session cache: it asks the manager (or the
residency owner), whose methods say what they mutate.
"""

from services.engine.kv.allocator import OutOfPagesError, PageAllocator
from services.engine.kv.manager import CopyOp, HostIndex, KVManager, PrefixMatch, RestoreReservation
from services.engine.kv.radix import RadixCache
from services.engine.kv.session_cache import SessionCache, SessionEntry
from services.engine.kv.session_residency import KvLocation, Residency, SessionResidency

__all__ = [
    "CopyOp",
    "HostIndex",
    "KVManager",
    "KvLocation",
    "OutOfPagesError",
    "PageAllocator",
    "PrefixMatch",
    "RadixCache",
    "Residency",
    "RestoreReservation",
    "SessionCache",
    "SessionEntry",
    "SessionResidency",
]
