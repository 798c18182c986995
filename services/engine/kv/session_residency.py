"""Where a session's KV is: the one owner of that answer for one model (pure Python, no torch, no I/O).

Design: a session's committed KV can be in three places, and the answer used to be assembled by several
holders (the executor's mirror table, the host tier's session list, the KV manager's prefix view), each
with its own spelling of the place (a ``str``, a ``Literal``, the proto enum). Here there is one spelling,
:class:`KvLocation`, converted to the proto ``KvState`` only at the wire edge (``services/engine/wire.py``),
and one owner per model, :class:`SessionResidency`, which answers ``where(session) -> Residency``:

* ``DEVICE`` -- the KV manager's session cache holds the session's committed tokens and pages;
* ``HOST`` -- not on the device, but this engine checkpointed it into the host store epoch that is up now
  (restorable; ``kv/host_tier.StoreIndex``);
* ``MISSING`` -- checkpointed into a store that has restarted or is unreachable (the next call recomputes).

Threads: the executor thread calls ``record`` after a call's release changed a session's device entry; any
thread may call ``where``/``device``/``sessions``: they read a table ``record`` keeps under a lock (the
session cache itself is the executor thread's), so a snapshot never waits for a step and nothing is copied
after every step. The table is filtered by the session cache's membership on read, so entries the cache has
evicted since are never reported as on the device.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the owner only reads these two: no import cycle at run time
    from services.engine.kv.host_tier import StoreIndex
    from services.engine.kv.manager import KVManager


class KvLocation(StrEnum):
    """Where a session's committed KV is (the string values are the snapshot's and the metrics' labels)."""

    DEVICE = "device"
    HOST = "host"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class Residency:
    """One session's residency: where its KV is, how many committed tokens, how many full pages on the
    device (0 off the device), the model, and when it was last used (wall clock)."""

    session_id: str
    where: KvLocation
    committed_tokens: int
    model: str = ""
    full_pages: int = 0
    last_use_unix: float = 0.0


def host_residencies(index: StoreIndex, available: bool, model: str) -> list[Residency]:
    """Every session ``index`` knows this engine checkpointed: ``HOST`` when committed into the store epoch up
    now and the store is ``available``, else ``MISSING``. Pure read (any thread)."""
    return [
        Residency(s.session_id, KvLocation(state), s.tokens, model, 0, s.last_use_unix)
        for s, state in index.states(available)
    ]


class SessionResidency:
    """The residency of every session of one model's engine: its device entries (the KV manager's session
    cache) and, when a host tier is attached, what it checkpointed. Mutates only its own table."""

    def __init__(self, kv: KVManager, model: str, wall: Callable[[], float] = time.time) -> None:
        self._kv = kv
        self.model = model
        self._wall = wall
        self._lock = threading.Lock()
        self._device: dict[str, Residency] = {}  # guarded by _lock; written by the executor thread
        self._host: tuple[StoreIndex, Callable[[], bool]] | None = None

    def attach_host(self, index: StoreIndex | None, available: Callable[[], bool] | None = None) -> None:
        """Answer for the host tier too (``index``: what it checkpointed; ``available``: whether its store is
        up now), or stop (None). Mutates: the owner's host port."""
        self._host = (index, available or (lambda: True)) if index is not None else None

    # ------------------------------------------------------------ executor thread
    def record(self, session_id: str) -> None:
        """The session's device entry changed (a call was released, or the session ended): record its
        residency for readers on other threads, and forget entries the session cache evicted since.
        Executor thread. Mutates: the device table."""
        cache, P = self._kv.sessions, self._kv.page_size
        entry = cache.peek(session_id)
        with self._lock:
            for sid in [sid for sid in self._device if sid not in cache]:
                del self._device[sid]
            if entry is not None:
                n = len(entry.token_ids)
                self._device[session_id] = Residency(session_id, KvLocation.DEVICE, n, self.model, n // P, self._wall())

    # ------------------------------------------------------------ any thread
    def device(self) -> list[Residency]:
        """Sessions whose committed KV is in the device session cache now."""
        with self._lock:
            out = list(self._device.values())
        cache = self._kv.sessions
        return [r for r in out if r.session_id in cache]

    def host(self) -> list[Residency]:
        """Sessions the host tier checkpointed (``HOST`` or ``MISSING``); empty without a host tier."""
        h = self._host
        return host_residencies(h[0], h[1](), self.model) if h is not None else []

    def sessions(self) -> list[Residency]:
        """Every known session once: on the device if it is there, else as the host tier knows it."""
        dev = self.device()
        on_device = {r.session_id for r in dev}
        return dev + [r for r in self.host() if r.session_id not in on_device]

    def where(self, session_id: str) -> Residency | None:
        """Where ``session_id``'s KV is: the device, else the host tier's knowledge, else None (unknown)."""
        with self._lock:
            r = self._device.get(session_id)
        if r is not None and session_id in self._kv.sessions:
            return r
        return next((h for h in self.host() if h.session_id == session_id), None)
