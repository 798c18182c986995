"""Session table: the router's memory of each agent session (last instance, model, KV length, last use).

Updated from completion hooks (``talaria.hook.completed``) and from the router's own placements. Bounded:
the least recently used sessions are forgotten first; sessions idle longer than ``ttl_s`` are dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from talaria.clock import Clock


@dataclass(slots=True)
class SessionEntry:
    session_id: str
    model: str
    instance_id: str
    committed_tokens: int
    last_use: float
    first_instance: str = ""  # where the session first landed (session-sticky baseline)
    done_unix: float = 0.0  # wall time the last call completed (from its completion hook)


class SessionTable:
    def __init__(self, clock: Clock, capacity: int = 100_000, ttl_s: float = 3600.0):
        self.clock = clock
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> SessionEntry | None:
        """The live entry of a session, or None (an expired entry is removed)."""
        e = self._entries.get(session_id)
        if e is None:
            return None
        if self.clock.now() - e.last_use > self.ttl_s:
            del self._entries[session_id]
            return None
        return e

    def record(
        self, session_id: str, model: str, instance_id: str, committed_tokens: int | None = None, done_unix: float | None = None
    ) -> SessionEntry:
        """Insert or refresh a session's entry; evicts the least recently used beyond capacity.

        ``committed_tokens``/``done_unix`` come from a completion hook; a placement passes neither."""
        now = self.clock.now()
        e = self._entries.pop(session_id, None)
        if e is None:
            e = SessionEntry(session_id, model, instance_id, committed_tokens or 0, now, instance_id, done_unix or 0.0)
        else:
            if e.model != model or e.instance_id != instance_id:
                e.done_unix = 0.0
                if e.model != model:
                    e.committed_tokens = 0
            e.model, e.instance_id, e.last_use = model, instance_id, now
            if committed_tokens is not None:
                e.committed_tokens = committed_tokens
            if done_unix is not None:
                e.done_unix = done_unix
        self._entries[session_id] = e
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return e

    def forget(self, session_id: str) -> SessionEntry | None:
        """Drop one session's entry (the session ended); returns it, or None if unknown."""
        return self._entries.pop(session_id, None)

    def forget_instance(self, instance_id: str) -> int:
        """Drop affinity to an instance (it died or restarted); returns how many sessions lost it."""
        gone = [s for s, e in self._entries.items() if e.instance_id == instance_id]
        for s in gone:
            del self._entries[s]
        return len(gone)
