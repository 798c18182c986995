"""Host KV tier policy and bookkeeping (pure Python, no torch, no I/O).

The mechanism (staging buffers, Mooncake, gRPC) is ``services/engine/host_kv.py``; this module holds
what it decides with, so the decision can be tested and reused by the router's simulator:

* :func:`decide_restore` — restore-or-recompute from *measured* costs (Talaria §4.3, JointServe §3.2 /
  §4.4: "reload versus recompute is decided online by the cost model"). Restoring ``n`` tokens costs a
  fixed control overhead (lookup + unpin round trips) plus ``n · restore_per_token``; recomputing costs
  ``n · prefill_per_token``. Both are EWMA-refreshed measurements of this engine; priors stand in until
  the first sample. The decision carries its cost breakdown so it can be logged and asserted.
* the refresh rule is the project's one EWMA (``talaria.ewma.Ewma``).
* :class:`HostSessions` — which sessions this engine has checkpointed, how far, into which store epoch,
  so the instance snapshot can say *host* (restorable from the store) or *missing* (the store restarted
  or is unreachable) for sessions whose device entry is gone.
* :class:`StoreIndex` — the page hashes and sessions known to be in the current store epoch; the KV
  manager's ``HostIndex`` port (``PrefixMatch.host_pages``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.kv.session_residency import KvLocation


@dataclass(frozen=True, slots=True)
class RestoreDecision:
    restore: bool
    tokens: int
    restore_s: float  # predicted: overhead + tokens * restore_per_token
    recompute_s: float  # predicted: tokens * prefill_per_token
    reason: str


RESTORE_MODES = ("auto", "always", "never")


def decide_restore(tokens: int, *, restore_per_token: float, prefill_per_token: float, overhead_s: float = 0.0, mode: str = "auto") -> RestoreDecision:
    """Restore ``tokens`` from the host store when that is predicted faster than recomputing them; ``mode``
    ``always`` / ``never`` (config ``host_kv_restore``) overrides the prediction, which is still reported."""
    if tokens <= 0:
        return RestoreDecision(False, 0, 0.0, 0.0, "nothing to restore")
    restore_s = overhead_s + tokens * restore_per_token
    recompute_s = tokens * prefill_per_token
    if mode != "auto":
        return RestoreDecision(mode == "always", tokens, restore_s, recompute_s, f"mode={mode}")
    if restore_s < recompute_s:
        return RestoreDecision(True, tokens, restore_s, recompute_s, "restore is cheaper")
    return RestoreDecision(False, tokens, restore_s, recompute_s, "recompute is cheaper")



@dataclass(slots=True)
class HostSession:
    session_id: str
    tokens: int  # page-aligned tokens committed to the store
    epoch: int  # store epoch they were committed in
    last_use_unix: float


class HostSessions:
    """Sessions checkpointed by this engine (bounded, oldest dropped first)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._s: dict[str, HostSession] = {}

    def committed(self, session_id: str, tokens: int, epoch: int, now_unix: float) -> None:
        self._s.pop(session_id, None)
        self._s[session_id] = HostSession(session_id, tokens, epoch, now_unix)
        while len(self._s) > self.max_entries:
            del self._s[next(iter(self._s))]

    def get(self, session_id: str) -> HostSession | None:
        return self._s.get(session_id)

    def drop(self, session_id: str) -> None:
        """Forget an ended session."""
        self._s.pop(session_id, None)

    def state(self, session_id: str, epoch: int, available: bool) -> KvLocation:
        """``HOST`` when the store we committed to is the one up now, else ``MISSING``."""
        s = self._s.get(session_id)
        return KvLocation.HOST if s is not None and available and s.epoch == epoch else KvLocation.MISSING

    def entries(self) -> list[HostSession]:
        return list(self._s.values())


class StoreIndex:
    """What this engine knows the host store holds: the page hashes committed into the current store epoch
    and the sessions checkpointed into it (pure, in memory; thread-safe). It is the KV manager's
    ``HostIndex`` port: ``match_prefix`` asks it how much of a prompt beyond the device may be restorable,
    so "how much of this session's prefix is where" is answered in one place (``kv/manager.py``).

    A call inside a session always asks the store (this engine may have restarted, or another instance of
    the node may have checkpointed it); a call outside any session asks only when the next page is known."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self.sessions = HostSessions(max_sessions)
        self.epoch = 0
        self._stored: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the port
    def restorable_pages(self, hashes: Sequence[int], start: int, session_id: str) -> int:
        if start >= len(hashes):
            return 0
        with self._lock:
            known = hashes[start] in self._stored
        return len(hashes) - start if (session_id or known) else 0

    def session_tokens(self, session_id: str) -> int:
        with self._lock:
            s = self.sessions.get(session_id)
        return s.tokens if s is not None else 0

    # ------------------------------------------------------------ updates (mutate the index)
    def saw_epoch(self, epoch: int) -> bool:
        """The store replied with ``epoch``; a new one means it restarted: forget what the old one held.
        Returns whether the epoch changed."""
        with self._lock:
            if epoch == self.epoch:
                return False
            old, self.epoch = self.epoch, epoch
            self._stored.clear()
            return bool(old)

    def forget(self) -> None:
        """The store failed: whether it comes back as the same store is unknown."""
        with self._lock:
            self.epoch = 0
            self._stored.clear()

    def discard(self, hashes: Sequence[int]) -> None:
        """Forget pages the store no longer serves (released, or failed their checksum). Mutates: the index."""
        with self._lock:
            self._stored.difference_update(hashes)

    def all_stored(self, hashes: Sequence[int]) -> bool:
        with self._lock:
            return all(h in self._stored for h in hashes)

    def committed(self, session_id: str, hashes: Sequence[int], tokens: int, epoch: int, now_unix: float, *, add: bool = True) -> None:
        """Pages ``hashes`` of ``session_id`` (``tokens`` tokens) are in the store of ``epoch``."""
        with self._lock:
            if add:
                self._stored.update(hashes)
            self.sessions.committed(session_id, tokens, epoch, now_unix)

    def states(self, available: bool) -> list[tuple[HostSession, KvLocation]]:
        """Every known session with its state (``HOST`` | ``MISSING``)."""
        with self._lock:
            return [(s, self.sessions.state(s.session_id, self.epoch, available)) for s in self.sessions.entries()]
